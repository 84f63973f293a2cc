-- Evict lower-band attempts for a preemptor and hold the hosts they free for it alone, in
-- one fenced step (docs/invariants.md, invariant 9). The victims keep their reservations
-- until their exits are confirmed (invariant 3): release.lua frees them as usual. From this
-- commit on, reserve.lua refuses every reservation and group claim on a held host but the
-- preemptor's, so no third job can take what the eviction frees; the preemptor's own
-- reservation there clears the hold (reserve.lua), as does unhold.lua.
-- KEYS[1] the fencing epoch; KEYS[2+2i], KEYS[3+2i]: host hash and allocation hash of host i.
-- ARGV[1] the caller's epoch; ARGV[2] JSON:
--   {"job": preemptor, "hosts": [worker ids], "held": [indices of the hosts to hold],
--    "victims": [{"h": host index, "key": attempt key}],
--    "need": [{"h": host index, "cpu", "mem", "disk", "dev"}]}
-- Returns {"ok", n victims} or {"stale_epoch", current} or {"conflict", why}.
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) ~= current then
  return {'stale_epoch', tostring(current)}
end
local req = cjson.decode(ARGV[2])
local function hkey(i) return KEYS[2 + 2 * i] end
local function akey(i) return KEYS[3 + 2 * i] end
local function name(i) return req.hosts[i + 1] end

for _, i in ipairs(req.held) do
  if redis.call('EXISTS', hkey(i)) == 0 then
    return {'conflict', 'unknown host ' .. name(i)}
  end
  local held = redis.call('HGET', hkey(i), 'held_for')
  if held and held ~= req.job then
    return {'conflict', 'host ' .. name(i) .. ' is held for preemptor ' .. held}
  end
end

-- Every victim must still be reserved where the caller saw it.
local freed = {}
local victims = {}
local victim_jobs = {}
for _, v in ipairs(req.victims) do
  local raw = redis.call('HGET', akey(v.h), v.key)
  if not raw then
    return {'conflict', 'victim ' .. v.key .. ' is not reserved on ' .. name(v.h)}
  end
  local a = cjson.decode(raw)
  victims[v.key] = true
  victim_jobs[a.job] = true
  local f = freed[v.h] or {cpu = 0, mem = 0, disk = 0, dev = 0}
  for _, d in ipairs({'cpu', 'mem', 'disk', 'dev'}) do f[d] = f[d] + a[d] end
  freed[v.h] = f
end

-- A gang holding a held host is evicted whole there: none of its reservations may stay.
for _, i in ipairs(req.held) do
  local gang = redis.call('HGET', hkey(i), 'gang')
  if gang and gang ~= req.job then
    if not victim_jobs[gang] then
      return {'conflict', 'host ' .. name(i) .. ' is held by gang ' .. gang .. ', not evicted'}
    end
    local allocs = redis.call('HGETALL', akey(i))
    for k = 1, #allocs, 2 do
      if not victims[allocs[k]] and cjson.decode(allocs[k + 1]).job == gang then
        return {'conflict', 'gang ' .. gang .. ' would keep ' .. allocs[k]}
      end
    end
  end
end

-- Once the victims are gone, the preemptor fits.
for _, n in ipairs(req.need) do
  local f = freed[n.h] or {cpu = 0, mem = 0, disk = 0, dev = 0}
  for _, d in ipairs({'cpu', 'mem', 'disk', 'dev'}) do
    local v = redis.call('HMGET', hkey(n.h), d .. '_cap', d .. '_used')
    local cap, used = tonumber(v[1] or '0'), tonumber(v[2] or '0')
    if used - f[d] + n[d] > cap then
      return {'conflict', 'evicting does not free enough on ' .. name(n.h) .. ' (' .. d .. ')'}
    end
  end
end

for _, i in ipairs(req.held) do
  redis.call('HSET', hkey(i), 'held_for', req.job)
end
return {'ok', tostring(#req.victims)}
