--[[
token_bucket.lua: decide every bucket of one request, all-or-nothing.

Semantics (DESIGN.md section 2): a bucket holds T' = min(C, T + elapsed * r);
the request is allowed when every bucket has cost <= T', and only then is
any bucket charged. A denial writes nothing. Time is the Redis clock (TIME),
never a gateway's.

Units: token counts are integers in units of 1/scale token, chosen by the
caller so that one microsecond refills a whole number of units; every value
stays below 2^53, so these double-precision numbers are exact integers.

KEYS[i]  the key of bucket i. Its value is the string
         "<units> <scale> <last_us>": units held at time last_us, written in
         units of 1/scale token. A missing key is a full bucket.
ARGV     4 integers per bucket, in KEYS order:
           4i-3  capacity  the capacity in units (tokens * scale)
           4i-2  refill    units added per microsecond
           4i-1  scale     units per token
           4i    cost      the cost in units (tokens * scale); 0 is a peek
Reply    3 integers per bucket, in KEYS order:
           remaining  whole tokens left (after the charge when allowed)
           wait_ms    0: this bucket allows; > 0: it denies, and can allow
                      after this many milliseconds (rounded up);
                      -1: the cost exceeds the capacity
           full_ms    milliseconds until the bucket is full again, rounded
                      up; for a charged bucket it is the TTL just set
A charged key gets a TTL of full_ms (PEXPIRE semantics via SET PX, >= 1 ms),
so an expired key is exactly a full bucket.
]]

local clock = redis.call('TIME')
local now = clock[1] * 1000000 + clock[2]

-- ceil(a / b) for integers a >= 0, b > 0, exact below 2^53.
local function ceildiv(a, b)
  local q = math.floor(a / b)
  if q * b < a then q = q + 1 end
  return q
end

-- floor(a / b) for integers a >= 0, b > 0, exact below 2^53.
local function floordiv(a, b)
  local q = math.floor(a / b)
  if q * b > a then q = q - 1 end
  return q
end

local n = #KEYS
local units, lasts = {}, {}
local allowed = true
local reply = {}

for i = 1, n do
  local a = 4 * i
  local cap, refill, scale, cost = tonumber(ARGV[a - 3]), tonumber(ARGV[a - 2]), tonumber(ARGV[a - 1]), tonumber(ARGV[a])
  local u, last = cap, now
  local v = redis.call('GET', KEYS[i])
  if v then
    local s1 = string.find(v, ' ', 1, true)
    local s2 = s1 and string.find(v, ' ', s1 + 1, true)
    if not s2 then
      return redis.error_reply('ERR token_bucket: malformed bucket state at ' .. KEYS[i])
    end
    u = tonumber(string.sub(v, 1, s1 - 1))
    local oldscale = tonumber(string.sub(v, s1 + 1, s2 - 1))
    last = tonumber(string.sub(v, s2 + 1))
    if oldscale ~= scale then
      -- The limit changed: keep whole tokens only, never grant a fraction.
      u = math.min(floordiv(u, oldscale), cap / scale) * scale
    elseif u > cap then
      u = cap
    end
    if now > last then
      if (now - last) * refill >= cap - u then
        u = cap
      else
        u = u + (now - last) * refill
      end
    end
  end
  units[i], lasts[i] = u, last
  local wait = 0
  if cost > cap then
    wait = -1
    allowed = false
  elseif cost > u then
    wait = ceildiv(cost - u, refill * 1000)
    allowed = false
  end
  reply[3 * i - 1] = wait
end

for i = 1, n do
  local a = 4 * i
  local cap, refill, scale, cost = tonumber(ARGV[a - 3]), tonumber(ARGV[a - 2]), tonumber(ARGV[a - 1]), tonumber(ARGV[a])
  local u, last = units[i], lasts[i]
  if allowed and cost > 0 then
    u = u - cost
    if now > last then last = now end
  end
  local full = ceildiv(cap - u, refill * 1000)
  if last > now then full = full + ceildiv(last - now, 1000) end
  if allowed and cost > 0 then
    redis.call('SET', KEYS[i], string.format('%d %d %d', u, scale, last), 'PX', full)
  end
  reply[3 * i - 2] = floordiv(u, scale)
  reply[3 * i] = full
end

return reply
