--[[
refund.lua: give back what token_bucket.lua charged, for a request that a
bucket on another Redis Cluster slot denied. It is appended to
token_bucket.lua in place of that script's main entry, so a bucket's state
is read and refilled by the same code (load, fullms).

A bucket charged c at t1 and refunded at t2 holds min(C, T(t2) + c), which
equals what it would hold at t2 had it never been charged: the refill up to
C is the same either way. So the net charge of a denied request is zero.

KEYS[i]  the key of bucket i, as in token_bucket.lua.
ARGV[i]  bucket i's parameters as in token_bucket.lua, the cost being the
         units to give back.
Reply    the number of buckets refunded. A key that is gone is a full
         bucket and needs nothing; a bucket refilled to full is deleted.
]]

local refunded = 0
for i = 1, #KEYS do
  local cap, refill, scale, cost = unpack('<dddd', ARGV[i])
  if cost > 0 and redis.call('EXISTS', KEYS[i]) == 1 then
    local u, last = load(KEYS[i], cap, refill, scale)
    if not u then return last end
    if now > last then last = now end
    u = math.min(cap, u + cost)
    if u >= cap then
      redis.call('DEL', KEYS[i])
    else
      redis.call('SET', KEYS[i], pack('<ddd', u, scale, last), 'PX', fullms(cap, refill, u, last))
    end
    refunded = refunded + 1
  end
end
return refunded
