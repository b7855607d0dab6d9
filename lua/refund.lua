--[[
refund.lua: give back what token_bucket.lua charged, for a request that a
bucket on another Redis Cluster slot denied. It follows token_bucket.lua's
prelude in place of that script's entry, and reads and refills a bucket
with its load block, so the state is read by the same code.

A bucket charged c at t1 and refunded at t2 holds min(C, T(t2) + c), which
equals what it would hold at t2 had it never been charged: the refill up to
C is the same either way. So the net charge of a denied request is zero.

KEYS[i]  the key of bucket i, as in token_bucket.lua.
ARGV[i]  bucket i's parameters as in token_bucket.lua, the cost being the
         units to give back; a concurrency limit gives back its slot by
         removing the lease ARGV[#KEYS + 1]; a calendar quota gives back
         its units in the window that holds now, when that is the window
         its key holds (a window that has reset keeps nothing to give).
Reply    the number of buckets refunded. A key that is gone is a full
         bucket and needs nothing; a bucket refilled to full is deleted.

Every bucket is read before anything is written, so a malformed bucket
state fails the call with nothing refunded.
]]

-- Read every bucket to refund: its units and state time, two per bucket;
-- false for a key that is gone.
local held = {}
for i = 1, #KEYS do
  local key = KEYS[i]
  local a = ARGV[i]
  local cap, refill, scale, cost, flags = unpack('<ddddd', a)
  local kind = floor(flags / 2)
  held[2 * i - 1] = false
  if cost > 0 and kind == 2 then
    local v = call('GET', key)
    if v then
      local w0, w1, w2 = unpack('<ddd', a, 41)
      local ws = w0
      if now >= w2 then ws = w2 elseif now >= w1 then ws = w1 end
      local used, _, vs = unpack('<ddd', v)
      if vs == ws then
        held[2 * i - 1] = used
      end
    end
  elseif cost > 0 and kind == 0 and call('EXISTS', key) == 1 then
    local u, last = cap, now
    --[[use load]]
    held[2 * i - 1] = u
    held[2 * i] = last
  end
end

local refunded = 0
for i = 1, #KEYS do
  local key = KEYS[i]
  local cap, refill, scale, cost, flags = unpack('<ddddd', ARGV[i])
  local kind = floor(flags / 2)
  local u, last = held[2 * i - 1], held[2 * i]
  if kind == 1 and cost > 0 then
    refunded = refunded + call('ZREM', key, ARGV[#KEYS + 1])
  elseif kind == 2 and u then
    u = u - cost
    if u < 0 then u = 0 end
    local _, _, vs = unpack('<ddd', call('GET', key))
    call('SET', key, pack('<ddd', u, 1, vs), 'KEEPTTL')
    refunded = refunded + 1
  elseif u then
    if now > last then last = now end
    u = u + cost
    if u > cap then u = cap end
    if u >= cap then
      call('DEL', key)
    else
      --[[use full]]
      call('SET', key, pack('<ddd', u, scale, last), 'PX', full)
    end
    refunded = refunded + 1
  end
end
return refunded
