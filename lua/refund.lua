--[[
refund.lua: give back what token_bucket.lua charged, for a request that a
bucket on another Redis Cluster slot denied.

A bucket charged c at t1 and refunded at t2 holds min(C, T(t2) + c), which
equals what it would hold at t2 had it never been charged: the refill up to
C is the same either way. So the net charge of a denied request is zero.

KEYS[i]  the key of bucket i, as in token_bucket.lua.
ARGV     4 integers per bucket, in KEYS order, as in token_bucket.lua:
         capacity, refill and scale in units, and the cost in units to give
         back.
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
  local a = 4 * i
  local cap, refill, scale, cost = tonumber(ARGV[a - 3]), tonumber(ARGV[a - 2]), tonumber(ARGV[a - 1]), tonumber(ARGV[a])
  local v = redis.call('GET', KEYS[i])
  if v and cost > 0 then
    local s1 = string.find(v, ' ', 1, true)
    local s2 = s1 and string.find(v, ' ', s1 + 1, true)
    if s2 and tonumber(string.sub(v, s1 + 1, s2 - 1)) == scale then
      local u = tonumber(string.sub(v, 1, s1 - 1))
      local last = tonumber(string.sub(v, s2 + 1))
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
        redis.call('SET', KEYS[i], string.format('%d %d %d', u, scale, last), 'PX', full)
      end
      refunded = refunded + 1
    end
  end
end
return refunded
