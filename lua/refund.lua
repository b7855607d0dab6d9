--[[
refund.lua: give back what token_bucket.lua charged, for a request that a
bucket on another Redis Cluster slot denied.

A bucket charged c at t1 and refunded at t2 holds min(C, T(t2) + c), which
equals what it would hold at t2 had it never been charged: the refill up to
C is the same either way. So the net charge of a denied request is zero.

KEYS[i]  the key of bucket i, as in token_bucket.lua.
ARGV[i]  bucket i's parameters as in token_bucket.lua, the cost being the
         units to give back.
Reply    the number of buckets refunded. A key that is gone is a full
         bucket and needs nothing; a bucket refilled to full is deleted.
]]

local clock = redis.call('TIME')
local now = clock[1] * 1000000 + clock[2]

local function ceildiv(a, b)
  local q = math.floor(a / b)
  if q * b < a then q = q + 1 end
  return q
end

local refunded = 0
for i = 1, #KEYS do
  local cap, refill, scale, cost = struct.unpack('<dddd', ARGV[i])
  local v = redis.call('GET', KEYS[i])
  if v and #v == 24 and cost > 0 then
    local u, oldscale, last = struct.unpack('<ddd', v)
    if oldscale == scale then
      if now > last then
        if (now - last) * refill >= cap - u then u = cap else u = u + (now - last) * refill end
        last = now
      end
      u = math.min(cap, u + cost)
      if u >= cap then
        redis.call('DEL', KEYS[i])
      else
        local full = ceildiv(cap - u, refill * 1000)
        if last > now then full = full + ceildiv(last - now, 1000) end
        redis.call('SET', KEYS[i], struct.pack('<ddd', u, scale, last), 'PX', full)
      end
      refunded = refunded + 1
    end
  end
end
return refunded
