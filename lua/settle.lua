--[[
settle.lua: charge or give back the difference between a request's
estimated and actual LLM tokens, once per request.

KEYS[1]  the settlement marker: SET NX, so a second settlement of the same
         request (a retried call) changes nothing.
KEYS[i]  (i >= 2) the token buckets charged by the request.
ARGV[1]  the marker's TTL in milliseconds.
ARGV[i]  (i >= 2) bucket i's parameters as in token_bucket.lua, the cost
         being the units to charge (> 0) or give back (< 0). A charge may
         take the bucket below zero: the debt blocks later requests until
         refill repays it; it is capped at one capacity. A bucket given
         back up to full is deleted.
Reply    1 when settled, 0 when the request was settled before.
]]

local clock = redis.call('TIME')
local now = clock[1] * 1000000 + clock[2]

if not redis.call('SET', KEYS[1], '1', 'NX', 'PX', ARGV[1]) then
  return 0
end

local floor, pack, unpack = math.floor, struct.pack, struct.unpack
for i = 2, #KEYS do
  local cap, refill, scale, delta = unpack('<dddd', ARGV[i])
  local u, last = cap, now
  local v = redis.call('GET', KEYS[i])
  if v and #v == 24 then
    local oldscale
    u, oldscale, last = unpack('<ddd', v)
    if oldscale ~= scale then
      local whole = floor(u / oldscale)
      if whole * oldscale > u then whole = whole - 1 end
      u = math.min(whole, cap / scale) * scale
    elseif u > cap then
      u = cap
    end
    if now > last then
      local grown = (now - last) * refill
      if grown >= cap - u then u = cap else u = u + grown end
    end
  end
  if now > last then last = now end
  u = u - delta
  if u < -cap then u = -cap end
  if u >= cap then
    redis.call('DEL', KEYS[i])
  else
    local d, per = cap - u, refill * 1000
    local full = floor(d / per)
    if full * per < d then full = full + 1 end
    if last > now then
      local ahead = floor((last - now) / 1000)
      if ahead * 1000 < last - now then ahead = ahead + 1 end
      full = full + ahead
    end
    redis.call('SET', KEYS[i], pack('<ddd', u, scale, last), 'PX', full)
  end
end
return 1
