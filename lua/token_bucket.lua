--[[
token_bucket.lua: decide every bucket of one request, all-or-nothing.

Semantics (DESIGN.md section 2): a bucket holds T' = min(C, T + elapsed * r);
the request is allowed when every bucket has cost <= T', and only then is
any bucket charged. A denial writes nothing. Time is the Redis clock (TIME),
never a gateway's.

Units: token counts are integers in units of 1/scale token, chosen by the
caller so that one microsecond refills a whole number of units; every value
stays below 2^53, so these double-precision numbers are exact integers.

KEYS[i]  the key of bucket i. Its value is 24 bytes, struct.pack('<ddd',
         units, scale, last_us): units held at time last_us (microseconds,
         Redis clock), counted in units of 1/scale token. A missing key is
         a full bucket.
ARGV[i]  bucket i's parameters, 32 bytes, struct.pack('<dddd', capacity,
         refill, scale, cost): the capacity in units (tokens * scale), the
         units added per microsecond, the units per token, and the cost in
         units (tokens * scale; 0 is a peek). Binary, so that the script
         spends no time converting text to numbers.
Reply    3 integers per bucket, in KEYS order:
           remaining  whole tokens left (after the charge when allowed)
           wait_ms    0: this bucket allows; > 0: it denies, and can allow
                      after this many milliseconds (rounded up);
                      -1: the cost exceeds the capacity
           full_ms    milliseconds until the bucket is full again, rounded
                      up; for a charged bucket it is the TTL just set
A charged key gets a TTL of full_ms (SET PX, >= 1 ms), so an expired key is
exactly a full bucket. A denied request costs one GET per bucket and no
write.
]]

local clock = redis.call('TIME')
local now = clock[1] * 1000000 + clock[2]

local floor, pack, unpack = math.floor, struct.pack, struct.unpack

-- load returns the units the bucket at key holds now, in the caller's
-- scale, and the time of its state: a missing key is a full bucket. On a
-- malformed value it returns nil and an error reply.
local function load(key, cap, refill, scale)
  local v = redis.call('GET', key)
  if not v then return cap, now end
  if #v ~= 24 then
    return nil, redis.error_reply('ERR token_bucket: malformed bucket state at ' .. key)
  end
  local u, oldscale, last = unpack('<ddd', v)
  if oldscale ~= scale then
    -- The limit changed: keep whole tokens only, never grant a fraction.
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
  return u, last
end

-- fullms returns the milliseconds, rounded up, until a bucket holding u
-- units with state time last is full: the key's TTL. A clock that stepped
-- back (last > now) adds the difference.
local function fullms(cap, refill, u, last)
  local d, per = cap - u, refill * 1000
  local full = floor(d / per)
  if full * per < d then full = full + 1 end
  if last > now then
    local ahead = floor((last - now) / 1000)
    if ahead * 1000 < last - now then ahead = ahead + 1 end
    full = full + ahead
  end
  return full
end

-- decide decides the n buckets KEYS[ko + i], ARGV[ao + i] (i = 1..n) and
-- returns the reply and whether the request is allowed.
local function decide(ko, ao, n)
  local reply = {}
  -- Per bucket, saved between the passes: units held and time of the state.
  local held, at = {}, {}
  local allowed = true

  -- Pass 1: refill and check every bucket; write nothing.
  for i = 1, n do
    local cap, refill, scale, cost = unpack('<dddd', ARGV[ao + i])
    local u, last = load(KEYS[ko + i], cap, refill, scale)
    if not u then return last end
    held[i], at[i] = u, last
    local wait = 0
    if cost > cap then
      wait, allowed = -1, false
    elseif cost > u then
      -- ceil((cost - u) / (refill * 1000)) milliseconds, exact below 2^53
      local d, per = cost - u, refill * 1000
      wait = floor(d / per)
      if wait * per < d then wait = wait + 1 end
      allowed = false
    end
    reply[3 * i - 1] = wait
  end

  -- Pass 2: charge every bucket if all allowed; report remaining and time
  -- until full.
  for i = 1, n do
    local cap, refill, scale, cost = unpack('<dddd', ARGV[ao + i])
    local u, last = held[i], at[i]
    local charge = allowed and cost > 0
    if charge then
      u = u - cost
      if now > last then last = now end
    end
    local full = fullms(cap, refill, u, last)
    if charge then
      redis.call('SET', KEYS[ko + i], pack('<ddd', u, scale, last), 'PX', full)
    end
    local rem = floor(u / scale)
    if rem * scale > u then rem = rem - 1 end
    reply[3 * i - 2] = rem
    reply[3 * i] = full
  end

  return reply, allowed
end

local reply = decide(0, 0, #KEYS)
return reply
