--[[
settle.lua: charge or give back the difference between a request's
estimated and actual LLM tokens, once per request. It follows
token_bucket.lua's prelude in place of that script's entry, and reads and
refills a bucket with its load block, so the state is read by the same
code.

KEYS[1]  the settlement marker: SET NX, so a second settlement of the same
         request (a retried call) changes nothing.
KEYS[i]  (i >= 2) the token buckets and calendar quotas charged by the
         request.
ARGV[1]  the marker's TTL in milliseconds.
ARGV[i]  (i >= 2) bucket i's parameters as in token_bucket.lua, the cost
         being the units to charge (> 0) or give back (< 0). A charge may
         take the bucket below zero: the debt blocks later requests until
         refill repays it; it is floored at minus one capacity, or at the
         deeper debt that reservations (on_limit wait) left it in (the
         caller bounds the cost to two capacities either way, which
         reaches the floor and full from anywhere). A bucket given back up to full is
         deleted. A calendar quota's ARGV adds 16 bytes, struct.pack('<dd',
         window_start, window_end): the window it was charged in; its
         units used go up or down by the cost, between 0 and two amounts,
         in that window only (a quota that has reset since is not
         settled). A charge in that window to a quota that holds no count
         of it (the request was charged nothing, so nothing was written)
         starts its count, until the window ends.
Reply    1 when settled, 0 when the request was settled before.

Every bucket is read before anything is written, the marker included, so a
malformed bucket state fails the call with nothing settled.
]]

if call('EXISTS', KEYS[1]) == 1 then
  return 0
end

-- Read every bucket: its units and state time, two per bucket.
local held = {}
for i = 2, #KEYS do
  local key, a = KEYS[i], ARGV[i]
  local cap, refill, scale, delta = unpack('<dddd', a)
  local u, last = cap, now
  if #a > 32 then
    -- A calendar quota: its units used, when the key holds the window the
    -- request was charged in; false: nothing to settle (it has reset). A
    -- key that holds no count of that window, or of an earlier one, counts
    -- 0 for a charge made before the window ends; last is then -1: the
    -- key is written with the window's TTL.
    local ws, we = unpack('<dd', a, 33)
    u = false
    local v = call('GET', key)
    local vs = false
    if v then
      local used, _, s = unpack('<ddd', v)
      vs = s
      if vs == ws then u = used end
    end
    if not u and (not vs or vs < ws) and delta > 0 and now < we then
      u, last = 0, -1
    end
  else
  --[[use load]]
  end
  held[2 * i - 3] = u
  held[2 * i - 2] = last
end

call('SET', KEYS[1], '1', 'PX', ARGV[1])
for i = 2, #KEYS do
  local key = KEYS[i]
  local a = ARGV[i]
  local cap, refill, scale, delta = unpack('<dddd', a)
  local u, last = held[2 * i - 3], held[2 * i - 2]
  if #a > 32 then
    if u then
      u = u + delta
      if u < 0 then u = 0 end
      if u > 2 * cap then u = 2 * cap end
      local ws, we = unpack('<dd', a, 33)
      if last == -1 then
        call('SET', key, pack('<ddd', u, 1, ws), 'PX', math.ceil((we - now) / 1000))
      else
        call('SET', key, pack('<ddd', u, 1, ws), 'KEEPTTL')
      end
    end
  else
  if now > last then last = now end
  -- The debt floor: one capacity, or the deeper debt of reservations
  -- (on_limit wait) that the bucket already holds.
  local least = -cap
  if u < least then least = u end
  u = u - delta
  if u < least then u = least end
  if u >= cap then
    call('DEL', key)
  else
    --[[use full]]
    call('SET', key, pack('<ddd', u, scale, last), 'PX', full)
  end
  end
end
return 1
