--[[
token_bucket.lua: decide every bucket of one request, all-or-nothing.

Semantics (docs/design.md section 2): a bucket holds T' = min(C, T + elapsed * r);
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
ARGV[i]  bucket i's parameters, 40 bytes, struct.pack('<ddddd', capacity,
         refill, scale, cost, flags): the capacity in units (tokens *
         scale), the units added per microsecond, the units per token, the
         cost in units (tokens * scale; 0 is a peek), and flags: shadow + 2
         * kind. Shadow (1): the bucket is decided and, when it allows an
         allowed request, charged, but its denial does not deny the
         request. Kind: 0 a token bucket, 1 a concurrency limit, 2 a
         calendar quota (below). A token bucket may add 8 bytes,
         struct.pack('<d', max_wait_ms): a reservation (on_limit wait) lets
         it allow a cost it holds only after a wait of up to max_wait_ms,
         charging it now (the bucket goes below zero by at most what
         refills in max_wait_ms) and replying that wait. Binary, so that
         the script spends no time converting text to numbers.
ARGV[#KEYS + 1]  the request's lease id, when a bucket is a concurrency
         limit.

A concurrency limit's key is a sorted set of leases, each scored by its
expiry in milliseconds on the Redis clock: capacity is its number of
slots (scale 1), refill its lease in milliseconds, cost 1 to take a slot
(0 to peek). Its free slots are capacity minus the leases that have not
expired; taking one adds the lease id with expiry now + lease, and the
key lives as long as its longest lease. It never refills: a slot comes
back when lease.lua releases the lease or the lease lapses. A full one
waits 1000 ms (Retry-After: 1), and reports full_ms 0.

A calendar quota counts the units used in the calendar window that holds
now: capacity is its amount (scale 1), refill 0, and its ARGV adds 32
bytes, struct.pack('<dddd', w0, w1, w2, w3): the starts of four
consecutive windows in microseconds (the gateway computes the calendar, in
its time zone; Redis's clock picks the window: [w0, w1), [w1, w2) or [w2,
w3), the nearest when now is outside them). Its value is struct.pack(
'<ddd', used, 1, window_start); a value of another window is an unused
quota. A full quota waits until its window ends; full_ms is the time until
then, and a charged key expires then.
Reply    3 integers per bucket, in KEYS order:
           remaining  whole tokens (free slots) left, after the charge when
                      the bucket was charged
           wait_ms    0: this bucket allows; > 0: it denies, and can allow
                      after this many milliseconds (rounded up), or, when
                      at most its max_wait_ms, it allows with a reservation
                      of this wait; -1: the cost exceeds the capacity
           full_ms    milliseconds until the bucket is full again, rounded
                      up; for a charged bucket it is the TTL just set
A charged key gets a TTL of full_ms (SET PX, >= 1 ms), so an expired key is
exactly a full bucket. A denied request costs one GET per bucket, one PTTL
per token bucket that is not full, and no write but a PEXPIRE of a key
whose TTL a faster limit set (see "Not charged, and not full").

The code is written inline, without Lua functions: Redis runs a script's
body on every call, so each `local function` would be a new closure per
call, and the calls and closures cost about 0.7 us of a 6 us decision.
The other scripts share this code by text instead (lua.go): the lines
between the marker comments "block NAME" and "end NAME" are pasted where
another script has the marker comment "use NAME". The blocks are:

  load    reads the bucket at `key` for parameters `cap, refill, scale`
          into `u, last`, declared by the user as `cap, now`: the units it
          holds now, in this scale (a missing key is a full bucket), and the
          time of its state.
  full    declares `full`: the milliseconds, rounded up, until a bucket
          holding `u` units with state time `last` is full (its TTL); a
          clock that stepped back (last > now) adds the difference.
  peek    reads bucket `key` with parameters `a` (unpacked into `cap,
          refill, scale, cost, flags`) without writing, and declares
          `kind, u, last, reserve, wait`: its kind, the units (free slots,
          quota left) it holds now, its state time (a quota's window end),
          its max_wait_ms, and its wait for `cost` as in the reply.
  decide  decides the n buckets KEYS[ko + i], ARGV[ao + i], i = 1..n, and
          declares `reply` and `allowed`.
]]

local clock = redis.call('TIME')
local now = clock[1] * 1000000 + clock[2]

local floor, pack, unpack, call = math.floor, struct.pack, struct.unpack, redis.call

local ko, ao, n = 0, 0, #KEYS
local lease = ARGV[n + 1]

--[[block decide]]
-- A constructor sizes the reply's array part at once; filling an empty
-- table would resize it on the way.
local reply
if n == 1 then
  reply = {0, 0, 0}
elseif n == 2 then
  reply = {0, 0, 0, 0, 0, 0}
elseif n >= 3 then
  reply = {0, 0, 0, 0, 0, 0, 0, 0, 0}
else
  reply = {} -- no bucket: an empty reply
end
local allowed = true

-- Pass 1: refill and check every bucket; write nothing. The reply keeps
-- each bucket's units and state time for pass 2.
local ms = floor(now / 1000)
for i = 1, n do
  local key, a = KEYS[ko + i], ARGV[ao + i]
  local cap, refill, scale, cost, flags = unpack('<ddddd', a)
  --[[block peek]]
  local kind = floor(flags / 2)
  local u, last, reserve = cap, now, 0
  if kind == 1 then
    -- A concurrency limit: the slots that no live lease holds.
    u = cap - call('ZCOUNT', key, '(' .. ms, '+inf')
  elseif kind == 2 then
    -- A calendar quota: what is left of it in the window that holds now;
    -- last is the window's end.
    local w0, w1, w2, w3 = unpack('<dddd', a, 41)
    local ws
    if now >= w2 then ws, last = w2, w3 elseif now >= w1 then ws, last = w1, w2 else ws, last = w0, w1 end
    local v = call('GET', key)
    if v then
      local used, _, vs = unpack('<ddd', v)
      if vs == ws then u = cap - used end
    end
  else
  if #a > 40 then reserve = unpack('<d', a, 41) end
  --[[block load]]
  local v = call('GET', key)
  if v then
    if #v ~= 24 then
      return redis.error_reply('ERR token_bucket: malformed bucket state at ' .. key)
    end
    local oldscale
    u, oldscale, last = unpack('<ddd', v)
    if oldscale ~= scale then
      -- The limit changed: keep whole tokens only, never grant a fraction.
      local whole = floor(u / oldscale)
      if whole * oldscale > u then whole = whole - 1 end
      u = whole * scale
      if u > cap then u = cap end
    elseif u > cap then
      u = cap
    end
    if now > last then
      local grown = (now - last) * refill
      if grown >= cap - u then u = cap else u = u + grown end
    end
  end
  --[[end load]]
  end
  local wait = 0
  if cost > cap then
    wait = -1
  elseif cost > u and kind == 1 then
    wait = 1000
  elseif cost > u and kind == 2 then
    wait = floor((last - now) / 1000)
    if wait * 1000 < last - now then wait = wait + 1 end
    if wait < 1 then wait = 1 end
  elseif cost > u then
    -- ceil((cost - u) / (refill * 1000)) milliseconds, exact below 2^53
    local d, per = cost - u, refill * 1000
    wait = floor(d / per)
    if wait * per < d then wait = wait + 1 end
  end
  --[[end peek]]
  if wait ~= 0 and flags % 2 == 0 and (wait < 0 or wait > reserve) then allowed = false end
  local j = 3 * i
  reply[j - 2] = u
  reply[j - 1] = wait
  reply[j] = last
end

-- Pass 2: charge every bucket if all allowed; report remaining and time
-- until full.
for i = 1, n do
  local a = ARGV[ao + i]
  local cap, refill, scale, cost, flags = unpack('<ddddd', a)
  local kind = floor(flags / 2)
  local j = 3 * i
  local u, last, wait = reply[j - 2], reply[j], reply[j - 1]
  -- A shadow bucket that denies is not charged: as if enforced. A bucket
  -- with a reservation is.
  local charge = allowed and cost > 0 and wait == 0
  if allowed and cost > 0 and wait > 0 and kind == 0 and #a > 40 then
    charge = wait <= unpack('<d', a, 41)
  end
  if kind == 2 then
    local full = floor((last - now) / 1000)
    if full * 1000 < last - now then full = full + 1 end
    if full < 1 then full = 1 end -- now past the last window: see above
    if charge then
      -- The window's start: the bound before its end.
      local w0, w1, w2 = unpack('<ddd', a, 41)
      local ws = w2
      if last == w1 then ws = w0 elseif last == w2 then ws = w1 end
      u = u - cost
      call('SET', KEYS[ko + i], pack('<ddd', cap - u, 1, ws), 'PX', full)
    end
    reply[j - 2] = u
    reply[j] = full
  elseif kind == 1 then
    if charge then
      local key = KEYS[ko + i]
      call('ZREMRANGEBYSCORE', key, '-inf', ms)
      call('ZADD', key, ms + refill, lease)
      if call('PTTL', key) < refill then call('PEXPIRE', key, refill) end
      u = u - cost
    end
    reply[j - 2] = u
    reply[j] = 0
  else
  if charge then
    u = u - cost
    if now > last then last = now end
  end
  --[[block full]]
  local d, per = cap - u, refill * 1000
  local full = floor(d / per)
  if full * per < d then full = full + 1 end
  if last > now then
    local ahead = floor((last - now) / 1000)
    if ahead * 1000 < last - now then ahead = ahead + 1 end
    full = full + ahead
  end
  --[[end full]]
  if charge then
    call('SET', KEYS[ko + i], pack('<ddd', u, scale, last), 'PX', full)
  elseif u < cap then
    -- Not charged, and not full, so its key exists: it must live until
    -- the bucket is full under this limit, which may refill slower than
    -- the one that last wrote it (a demotion, a tier change, a reload),
    -- or it would expire into a full bucket: expiry never changes a
    -- decision.
    local key = KEYS[ko + i]
    if call('PTTL', key) < full then call('PEXPIRE', key, full) end
  end
  local rem = floor(u / scale)
  if rem * scale > u then rem = rem - 1 end
  reply[j - 2] = rem
  reply[j] = full
  end
end
--[[end decide]]

return reply
