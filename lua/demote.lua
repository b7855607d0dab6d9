--[[
demote.lua: token_bucket.lua for a handler with a demotion rule. It follows
token_bucket.lua's prelude in place of that script's entry, and decides with
its decide block, so the decision is the same code.

An identity that keeps hammering while limited is moved to a stricter tier
for a while: every denial (rate_limit_exceeded, not cost_exceeds_capacity)
is counted in a window; at the threshold the identity is demoted, and until
the demotion lapses its requests are decided on the penalty tier's limits.
Counting and demotion happen in this same call.

KEYS[1]  the demotion marker of the identity (PX = what is left of it)
KEYS[2]  the identity's denial counter (PX = the window)
KEYS[2 + i], i = 1..n          the buckets of the request's own tier
KEYS[2 + n + i], i = 1..m      the same request's buckets on the penalty tier
ARGV[1]  struct.pack('<dddd', n, threshold, window_ms, demote_ms)
ARGV[1 + i]                    bucket parameters, as in token_bucket.lua,
                               in KEYS order from KEYS[3]
ARGV[#KEYS]                    the request's lease id, when a bucket is a
                               concurrency limit
Reply    {demoted, demoted_ms, other_ms, <token_bucket.lua's reply>}:
         demoted is 0 (the own tier decided), 1 (demoted before: the
         penalty tier decided), 2 (this denial demoted the identity);
         demoted_ms is what is left of the demotion; other_ms is, for a
         denial when the tier that decides changes before the deciding
         tier could serve the request, the wait of the other tier, read
         without writing: the own tier's, for a demoted request denied for
         longer than demoted_ms (the own tier decides after that), and the
         penalty tier's, for the denial that demotes (the penalty tier
         decides next). It is the longest wait of that tier's enforced
         buckets, -1 when one of them can never serve the cost or cannot
         be read, and 0 otherwise.
]]

local nn, threshold, window, span = unpack('<dddd', ARGV[1])
local lease = nil
if #ARGV == #KEYS then lease = ARGV[#KEYS] end
local left = call('PTTL', KEYS[1])
local demoted = left > 0
-- The buckets to decide: the penalty tier's while demoted, else the own.
local ko, ao, n = 2, 1, nn
if demoted then ko, ao, n = 2 + nn, 1 + nn, #KEYS - 2 - nn end

--[[use decide]]

-- When the tier that decides changes before the deciding tier could serve
-- the request, the other tier's wait is read too (see other_ms above):
-- buckets KEYS[pk + i], ARGV[pa + i], i = 1..pm; with ttls, its token
-- buckets that are not full also get their TTLs raised.
local state, other = 0, 0
local pk, pa, pm, ttls = 0, 0, 0, false
if demoted then
  state = 1
  local longest = 0
  if not allowed then
    for i = 1, n do
      local wait, flags = reply[3 * i - 1], select(5, unpack('<ddddd', ARGV[ao + i]))
      if flags % 2 == 0 and wait > longest then longest = wait end
    end
  end
  if longest > left then pk, pa, pm = 2, 1, nn end
else
  left = 0
  -- Only an enforced bucket's denial counts: not a shadow one's, nor a
  -- reservation (a wait within the bucket's max_wait_ms).
  local limited = false
  for i = 1, n do
    local wait = reply[3 * i - 1]
    if not allowed and wait > 0 then
      local a = ARGV[ao + i]
      local flags = select(5, unpack('<ddddd', a))
      local reserve = 0
      if #a > 40 and floor(flags / 2) == 0 then reserve = unpack('<d', a, 41) end
      if flags % 2 == 0 and wait > reserve then limited = true end
    end
  end
  if limited then
    local count = call('INCR', KEYS[2])
    if count == 1 then call('PEXPIRE', KEYS[2], window) end
    if count >= threshold then
      call('SET', KEYS[1], '1', 'PX', span)
      call('DEL', KEYS[2])
      state, left = 2, span
      -- The penalty tier decides next. Its token buckets (the same keys, as
      -- a rule) took their TTLs from the own tier's limits, which may refill
      -- them faster: they must live until full under the penalty tier's, or
      -- the first request of the demotion would find them expired, full (see
      -- token_bucket.lua, "Not charged, and not full").
      pk, pa, pm, ttls = 2 + nn, 1 + nn, #KEYS - 2 - nn, true
    end
  end
end
-- A key the deciding tier did not read may hold anything: one that cannot
-- be read makes the wait -1 and keeps its TTL (a later decision reports
-- it), so that it does not undo the demotion after the INCR above. The
-- closures are made only on these rare paths.
for i = 1, pm do
  local key, a = KEYS[pk + i], ARGV[pa + i]
  local ok, wait, ttl = pcall(function()
    local cap, refill, scale, cost, flags = unpack('<ddddd', a)
    --[[use peek]]
    if flags % 2 == 1 then wait = 0 end -- a shadow bucket never makes it wait
    if not ttls or kind ~= 0 or u >= cap then return wait, false end
    --[[use full]]
    return wait, full
  end)
  if not ok or type(wait) ~= 'number' then
    other = -1
  else
    if other >= 0 and (wait < 0 or wait > other) then other = wait end
    if ttl and call('PTTL', key) < ttl then call('PEXPIRE', key, ttl) end
  end
end
table.insert(reply, 1, other)
table.insert(reply, 1, left)
table.insert(reply, 1, state)
return reply
