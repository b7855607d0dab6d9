--[[
batch.lua: token_bucket.lua for several requests in one call. It follows
token_bucket.lua's prelude in place of that script's entry, and decides each
request with its decide block, in order, so each decision is the one that
script would make, on the state the requests before it left. A gateway
sends its concurrent requests' decisions this way: one script call and one
clock read for the lot, instead of one each.

ARGV[1]  one byte per request, in order: its number of buckets n (1 to
         127), plus 128 when its lease id follows its buckets' parameters
KEYS     the requests' keys, request after request, n each, as
         token_bucket.lua's KEYS
ARGV[2..]  the requests' parameters, request after request: n buckets'
         parameters as token_bucket.lua's ARGV, then the lease id when the
         request's byte says so
Reply    one element per request, in order: the reply token_bucket.lua
         would give it, or the error reply it would give. A request that
         fails (a malformed bucket state, a key of another type) fails
         alone: it wrote nothing, and the others are decided as if it had
         not been sent.

A request is decided in a function called with pcall, so that a failed
redis.call fails that request rather than the script: one closure per call,
and one call per request, not per bucket.
]]

local heads = ARGV[1]

local function decide(ko, ao, n, lease)
  local now, floor, pack, unpack, call = now, floor, pack, unpack, call
  --[[use decide]]
  return reply
end

local out = {}
local ko, ao = 0, 1
for r = 1, #heads do
  local h = string.byte(heads, r)
  local n, lease = h % 128, nil
  if h >= 128 then lease = ARGV[ao + n + 1] end
  local ok, res = pcall(decide, ko, ao, n, lease)
  if ok or type(res) == 'table' then
    out[r] = res
  else
    out[r] = redis.error_reply(tostring(res))
  end
  ko = ko + n
  if h >= 128 then ao = ao + n + 1 else ao = ao + n end
end
return out
