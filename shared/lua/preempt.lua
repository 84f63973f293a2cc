-- Evict lower-band attempts for preemptors and hold the hosts they free for each of them
-- alone, in one fenced call for a whole tick (docs/invariants.md, invariant 9). Each
-- preemptor's eviction is all or nothing: checked, then written, before the next one is
-- checked (so the next sees its holds); one that fails a check writes nothing and the call
-- goes on with the next. The victims keep their reservations until their exits are
-- confirmed (invariant 3): release.lua frees them as usual. From this commit on,
-- reserve.lua refuses every reservation and group claim on a held host but the
-- preemptor's, so no third job can take what the eviction frees; the preemptor's own
-- reservation there clears the hold (reserve.lua), as does unhold.lua.
-- KEYS[1] the fencing epoch; KEYS[2+2i], KEYS[3+2i]: host hash and allocation hash of host i.
-- ARGV[1] the caller's epoch; ARGV[2] JSON:
--   {"hosts": [worker ids], "evictions": [
--     {"job": preemptor, "held": [indices of the hosts to hold],
--      "victims": [{"h": host index, "key": attempt key}],
--      "need": [{"h": host index, "cpu", "mem", "disk", "dev"}]}, ...]}
-- Returns {"stale_epoch", current} (nothing written), or {"ok", r1, r2, ...}: per eviction
-- in order, "" if committed, else why it was refused.
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) ~= current then
  return {'stale_epoch', tostring(current)}
end
local req = cjson.decode(ARGV[2])
local function hkey(i) return KEYS[2 + 2 * i] end
local function akey(i) return KEYS[3 + 2 * i] end
local function name(i) return req.hosts[i + 1] end

-- The checks of one eviction: nil if it may be committed, else why not.
local function refusal(e)
  for _, i in ipairs(e.held) do
    if redis.call('EXISTS', hkey(i)) == 0 then
      return 'unknown host ' .. name(i)
    end
    local held = redis.call('HGET', hkey(i), 'held_for')
    if held and held ~= e.job then
      return 'host ' .. name(i) .. ' is held for preemptor ' .. held
    end
  end

  -- Every victim must still be reserved where the caller saw it.
  local freed = {}
  local victims = {}
  local victim_jobs = {}
  for _, v in ipairs(e.victims) do
    local raw = redis.call('HGET', akey(v.h), v.key)
    if not raw then
      return 'victim ' .. v.key .. ' is not reserved on ' .. name(v.h)
    end
    local a = cjson.decode(raw)
    victims[v.key] = true
    victim_jobs[a.job] = true
    local f = freed[v.h] or {cpu = 0, mem = 0, disk = 0, dev = 0}
    for _, d in ipairs({'cpu', 'mem', 'disk', 'dev'}) do f[d] = f[d] + a[d] end
    freed[v.h] = f
  end

  -- A gang holding a held host is evicted whole there: none of its reservations may stay.
  for _, i in ipairs(e.held) do
    local gang = redis.call('HGET', hkey(i), 'gang')
    if gang and gang ~= e.job then
      if not victim_jobs[gang] then
        return 'host ' .. name(i) .. ' is held by gang ' .. gang .. ', not evicted'
      end
      local allocs = redis.call('HGETALL', akey(i))
      for k = 1, #allocs, 2 do
        if not victims[allocs[k]] and cjson.decode(allocs[k + 1]).job == gang then
          return 'gang ' .. gang .. ' would keep ' .. allocs[k]
        end
      end
    end
  end

  -- Once the victims are gone, the preemptor fits.
  for _, n in ipairs(e.need) do
    local f = freed[n.h] or {cpu = 0, mem = 0, disk = 0, dev = 0}
    for _, d in ipairs({'cpu', 'mem', 'disk', 'dev'}) do
      local v = redis.call('HMGET', hkey(n.h), d .. '_cap', d .. '_used')
      local cap, used = tonumber(v[1] or '0'), tonumber(v[2] or '0')
      if used - f[d] + n[d] > cap then
        return 'evicting does not free enough on ' .. name(n.h) .. ' (' .. d .. ')'
      end
    end
  end
  return nil
end

local out = {'ok'}
for _, e in ipairs(req.evictions) do
  local why = refusal(e)
  if why then
    out[#out + 1] = why
  else
    for _, i in ipairs(e.held) do
      redis.call('HSET', hkey(i), 'held_for', e.job)
    end
    out[#out + 1] = ''
  end
end
return out
