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
Reply    {demoted, demoted_ms, <token_bucket.lua's reply>}: demoted is 0
         (the own tier decided), 1 (demoted before: the penalty tier
         decided), 2 (this denial demoted the identity); demoted_ms is what
         is left of the demotion.
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

local state = 0
if demoted then
  state = 1
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
      -- The penalty tier's buckets (the same keys, as a rule) took their
      -- TTLs from the own tier's limits, which may refill them faster: they
      -- must live until full under the penalty tier's, or the first
      -- request of the demotion would find them expired, full (see
      -- token_bucket.lua, "Not charged, and not full"). Read them first.
      -- A key the own tier did not read may hold anything: one that cannot
      -- be read is skipped (the penalty tier's decision reports it), so
      -- that it does not undo the demotion after the INCR above. The
      -- closure is made only when an identity is demoted.
      local raise = {}
      for i = 1, #KEYS - 2 - nn do
        local key, a = KEYS[2 + nn + i], ARGV[1 + nn + i]
        local ok, full = pcall(function()
          local cap, refill, scale, _, flags = unpack('<ddddd', a)
          if floor(flags / 2) ~= 0 then return false end
          local u, last = cap, now
          --[[use load]]
          if u >= cap then return false end
          --[[use full]]
          return full
        end)
        if ok and type(full) == 'number' then
          raise[#raise + 1] = key
          raise[#raise + 1] = full
        end
      end
      call('SET', KEYS[1], '1', 'PX', span)
      call('DEL', KEYS[2])
      state, left = 2, span
      for j = 1, #raise, 2 do
        if call('PTTL', raise[j]) < raise[j + 1] then call('PEXPIRE', raise[j], raise[j + 1]) end
      end
    end
  end
end
table.insert(reply, 1, left)
table.insert(reply, 1, state)
return reply
