--[[
batch.lua: token_bucket.lua for several requests in one call. It follows
token_bucket.lua's prelude in place of that script's entry, and decides each
request with its decide block, in order, so each decision is the one that
script would make, on the state the requests before it left. A gateway
sends its concurrent requests' decisions this way: one script call and one
clock read for the lot, instead of one each.

ARGV[1]  a flags byte, then one byte per request, in order: its number of
         buckets n (1 to 127), plus 128 when its lease id follows its
         buckets' parameters. Flags 1: some key is used by more than one
         request (see below); else 0.
KEYS     the requests' keys, request after request, n each, as
         token_bucket.lua's KEYS
ARGV[2..]  the requests' parameters, request after request: n buckets'
         parameters as token_bucket.lua's ARGV, then the lease id when the
         request's byte says so
Reply    one element per request, in order: the reply token_bucket.lua
         would give it, or the error reply it would give. A request that
         fails (a malformed bucket state, a key of another type) fails
         alone: every check comes before its first write, and the others
         are decided as if it had not been sent.

A request is decided in a function called with pcall, so that a failed
redis.call fails that request rather than the script: one closure per call,
and one call per request, not per bucket.

With flags 1, a token bucket's or quota's key is read (GET) once, when a
request first needs it, and written (SET ... PX) once, after the last
request, with the value and TTL of the last request that charged it; the
requests in between read the state the ones before them left, from the
script's memory. Redis's clock stands still during a script, so nothing
expires in between, and a key written later than its last charge lives a
few microseconds longer, still a full bucket when it expires. A request of
a tenant's many concurrent ones then costs Redis no command for the buckets
they share. Without repeated keys the reads and writes go to Redis as they
come, with no table to keep.
]]

local heads = ARGV[1]
local rcall = redis.call

local seen, ttl, order = {}, {}, {}
local function cached(cmd, key, ...)
  if cmd == 'GET' then
    local v = seen[key]
    if v == nil then
      v = rcall('GET', key) -- false when missing
      seen[key] = v
    end
    return v
  elseif cmd == 'SET' then -- SET key value PX ms
    local v, _, ms = ...
    if ttl[key] == nil then order[#order + 1] = key end
    seen[key], ttl[key] = v, ms
    return true
  elseif cmd == 'PTTL' and ttl[key] ~= nil then -- a write to come
    return ttl[key]
  elseif cmd == 'PEXPIRE' and ttl[key] ~= nil then
    ttl[key] = ...
    return 1
  end
  return rcall(cmd, key, ...)
end
local via = rcall
if string.byte(heads, 1) == 1 then via = cached end

local function decide(ko, ao, n, lease)
  local now, floor, pack, unpack, call = now, floor, pack, unpack, via
  --[[use decide]]
  return reply
end

local out = {}
local ko, ao = 0, 1
for r = 2, #heads do
  local h = string.byte(heads, r)
  local n, lease = h % 128, nil
  if h >= 128 then lease = ARGV[ao + n + 1] end
  local ok, res = pcall(decide, ko, ao, n, lease)
  if ok or type(res) == 'table' then
    out[r - 1] = res
  else
    out[r - 1] = redis.error_reply(tostring(res))
  end
  ko = ko + n
  if h >= 128 then ao = ao + n + 1 else ao = ao + n end
end
for i = 1, #order do
  local key = order[i]
  rcall('SET', key, seen[key], 'PX', ttl[key])
end
return out
