--[[
lease.lua: renew or release a request's leases on its concurrency limits
(see token_bucket.lua). It follows token_bucket.lua's prelude in place of
that script's entry, for its clock.

KEYS[i]  the sorted set of leases of concurrency limit i.
ARGV[1]  the lease id.
ARGV[2]  the lease in milliseconds: > 0 renews the lease to expire that
         long from now (a lease that is gone, released or lapsed, is not
         taken again); 0 releases it.
Reply    the number of keys that held the lease: for a release, the slots
         given back, so that a release made twice gives back nothing the
         second time.
]]

local id, span = ARGV[1], tonumber(ARGV[2])
local ms = floor(now / 1000)
local held = 0
for i = 1, #KEYS do
  local key = KEYS[i]
  -- A lease past its expiry is gone, though a take has not yet swept it
  -- out of the set: it is neither renewed nor counted as released.
  local score = call('ZSCORE', key, id)
  local live = score and tonumber(score) > ms
  if span == 0 then
    call('ZREM', key, id)
    if live then held = held + 1 end
  elseif live then
    call('ZADD', key, 'XX', ms + span, id)
    if call('PTTL', key) < span then call('PEXPIRE', key, span) end
    held = held + 1
  end
end
return held
