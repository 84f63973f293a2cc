-- Commit every placement of one scheduling tick, all or nothing, after re-checking, for every
-- host it touches: capacity (cpu, memory, disk, devices), the device kind, named ports, and
-- gang ownership of coscheduling groups, and preemption holds (a host held for a preemptor
-- takes only it; its reservation there clears the hold). Nothing is written unless
-- everything holds.
-- Named ports belong to the host's address, not to the worker: workers sharing an address
-- share one port hash, so a port goes to one live attempt per address.
-- Devices are pinned the same way, per host: an attempt asking for N devices names N of the
-- host's registered device indices, each free in the host's device hash, and holds them
-- there until its release (so no device is ever given to two live attempts).
-- KEYS[1] the fencing epoch; KEYS[2] the set of held group keys;
-- KEYS[3+4i], KEYS[4+4i], KEYS[5+4i], KEYS[6+4i]: host hash, allocation hash, the port
--   hash of the address of host i (hosts sharing an address repeat the same key) and its
--   device hash (i = 0 .. #hosts-1); then KEYS[3+4H+j]: the group hash of group j (j = 0 ..);
--   last, the limits hash and the limits-use hash (redis_keys.LIMITS, LIMITS_USED).
-- Quotas and tokens (shared/limits.py) are checked and taken here too, for the commit as a
-- whole: each user's live reservations stay within its quota (its own, else the default,
-- one dimension at a time), each token's within its limit, so a gang is admitted whole or
-- not at all. "check": false (re-reserving what already runs) takes without checking.
-- ARGV[1] the caller's epoch; ARGV[2] JSON:
--   {"hosts": [worker ids], "r": [{"h": host index, "key": attempt key, "job": job id,
--     "cpu", "mem", "disk", "dev": amounts, "kind": device kind, "ports": [numbers],
--     "devs": [device indices, one per dev; empty only for an attempt logged before
--     devices were pinned], "g": group index or -1, "u": user, "tok": {token: n}}],
--    "check": bool,
--    "g": [{"name", "job", "members": [host indices], "exclusive": bool}]}
-- Returns {"ok", n} or {"stale_epoch", current} or {"conflict", why}.
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) ~= current then
  return {'stale_epoch', tostring(current)}
end
local req = cjson.decode(ARGV[2])
local H = #req.hosts
local function hkey(i) return KEYS[3 + 4 * i] end
local function akey(i) return KEYS[4 + 4 * i] end
local function pkey(i) return KEYS[5 + 4 * i] end
local function dkey(i) return KEYS[6 + 4 * i] end
local function gkey(j) return KEYS[3 + 4 * H + j] end
local function name(i) return req.hosts[i + 1] end

-- What this script reads of host i, read once (one HMGET, not a call per field per
-- reservation: at a thousand reservations per commit those calls were most of its time).
-- A registered host always has cpu_cap (register_host.lua). Missing fields are false.
local FIELDS = {'cpu_cap', 'mem_cap', 'disk_cap', 'dev_cap', 'cpu_used', 'mem_used',
                'disk_used', 'dev_used', 'held_for', 'gang', 'dev_kind', 'dev_ids'}
local infos = {}
local function info(i)
  local x = infos[i]
  if x == nil then
    local v = redis.call('HMGET', hkey(i), unpack(FIELDS))
    x = {}
    for n, f in ipairs(FIELDS) do x[f] = v[n] end
    infos[i] = x
  end
  return x
end

-- The device indices host i registered (dev_ids), or 0..dev_cap-1 if it registered none.
local known = {}
local function has_device(i, d)
  if known[i] == nil then
    local ids = {}
    local raw = info(i).dev_ids
    if raw then
      for _, x in ipairs(cjson.decode(raw)) do ids[tostring(x)] = true end
    else
      local cap = tonumber(info(i).dev_cap or '0')
      for x = 0, cap - 1 do ids[tostring(x)] = true end
    end
    known[i] = ids
  end
  return known[i][tostring(d)] == true
end

-- A group goes to one gang at a time, and no host of it may be held by another gang.
for j0, g in ipairs(req.g) do
  local owner = redis.call('HGET', gkey(j0 - 1), 'owner')
  if owner and owner ~= g.job then
    return {'conflict', 'group ' .. g.name .. ' is held by ' .. owner}
  end
  for _, m in ipairs(g.members) do
    local holder = info(m).gang
    if holder and holder ~= g.job then
      return {'conflict', 'host ' .. name(m) .. ' is held by gang ' .. holder}
    end
    local held = info(m).held_for
    if held and held ~= g.job then
      return {'conflict', 'host ' .. name(m) .. ' is held for preemptor ' .. held}
    end
  end
end

local dims = {'cpu', 'mem', 'disk', 'dev'}
local want = {}
local ports_seen = {}
local devs_seen = {}
for _, r in ipairs(req.r) do
  local h = r.h
  local x = info(h)
  if not x.cpu_cap then
    return {'conflict', 'unknown host ' .. name(h)}
  end
  if redis.call('HEXISTS', akey(h), r.key) == 1 then
    return {'conflict', 'attempt ' .. r.key .. ' already reserved'}
  end
  -- A host held for a preemptor (preempt.lua) takes no one else.
  if x.held_for and x.held_for ~= r.job then
    return {'conflict', 'host ' .. name(h) .. ' is held for preemptor ' .. x.held_for}
  end
  if r.g >= 0 and x.gang and x.gang ~= r.job then
    return {'conflict', 'host ' .. name(h) .. ' is held by gang ' .. x.gang}
  end
  if r.dev > 0 and x.dev_kind ~= r.kind then
    return {'conflict', 'host ' .. name(h) .. ' has no device ' .. r.kind}
  end
  for _, p in ipairs(r.ports) do
    local seen = pkey(h) .. ':' .. p
    if ports_seen[seen] or redis.call('HEXISTS', pkey(h), p) == 1 then
      return {'conflict', 'port ' .. p .. ' of ' .. name(h) .. "'s address is taken"}
    end
    ports_seen[seen] = true
  end
  if #r.devs > 0 and #r.devs ~= r.dev then
    return {'conflict', 'attempt ' .. r.key .. ' names ' .. #r.devs .. ' devices for ' .. r.dev}
  end
  for _, d in ipairs(r.devs) do
    local seen = h .. ':' .. d
    if not has_device(h, d) then
      return {'conflict', 'host ' .. name(h) .. ' has no device ' .. d}
    end
    if devs_seen[seen] or redis.call('HEXISTS', dkey(h), d) == 1 then
      return {'conflict', 'device ' .. d .. ' of ' .. name(h) .. ' is taken'}
    end
    devs_seen[seen] = true
  end
  local w = want[h] or {cpu = 0, mem = 0, disk = 0, dev = 0}
  for _, d in ipairs(dims) do w[d] = w[d] + r[d] end
  want[h] = w
end
for h, w in pairs(want) do
  local x = info(h)
  for _, d in ipairs(dims) do
    local cap, used = tonumber(x[d .. '_cap'] or '0'), tonumber(x[d .. '_used'] or '0')
    if used + w[d] > cap then
      return {'conflict', 'over capacity on ' .. name(h) .. ' (' .. d .. ')'}
    end
  end
end

-- Quotas and tokens, for the whole commit at once.
local LK, UK = KEYS[#KEYS - 1], KEYS[#KEYS]
local qdims = {'cpu', 'mem', 'dev'}
local uwant, twant = {}, {}
for _, r in ipairs(req.r) do
  local u = uwant[r.u] or {cpu = 0, mem = 0, dev = 0}
  for _, d in ipairs(qdims) do u[d] = u[d] + r[d] end
  uwant[r.u] = u
  if type(r.tok) == 'table' then
    for t, n in pairs(r.tok) do twant[t] = (twant[t] or 0) + n end
  end
end
if req.check ~= false then
  local dq = cjson.decode(redis.call('HGET', LK, 'qd') or '{}')
  for user, w in pairs(uwant) do
    local uq = cjson.decode(redis.call('HGET', LK, 'q:' .. user) or '{}')
    for _, d in ipairs(qdims) do
      local limit = uq[d] or dq[d]
      if limit and w[d] > 0 then
        local used = tonumber(redis.call('HGET', UK, d .. ':' .. user) or '0')
        if used + w[d] > limit then
          return {'conflict', 'user quota ' .. user .. ': ' .. d .. ' ' .. used .. ' + ' ..
                  w[d] .. ' over ' .. limit}
        end
      end
    end
  end
  for t, n in pairs(twant) do
    local limit = tonumber(redis.call('HGET', LK, 't:' .. t) or '-1')
    if limit < 0 then return {'conflict', 'no token ' .. t} end
    local used = tonumber(redis.call('HGET', UK, 't:' .. t) or '0')
    if used + n > limit then
      return {'conflict', 'token ' .. t .. ': ' .. used .. ' + ' .. n .. ' over ' .. limit}
    end
  end
end

for user, w in pairs(uwant) do
  for _, d in ipairs(qdims) do
    if w[d] > 0 then redis.call('HINCRBY', UK, d .. ':' .. user, w[d]) end
  end
end
for t, n in pairs(twant) do redis.call('HINCRBY', UK, 't:' .. t, n) end

for _, r in ipairs(req.r) do
  local h = r.h
  local group = ''
  if r.g >= 0 then
    group = gkey(r.g)
    redis.call('HINCRBY', group, 'live', 1)
  end
  redis.call('HSET', akey(h), r.key, cjson.encode({job = r.job, cpu = r.cpu, mem = r.mem,
    disk = r.disk, dev = r.dev, ports = r.ports, pk = pkey(h), devs = r.devs, dk = dkey(h),
    group = group, u = r.u, tok = r.tok}))
  for _, p in ipairs(r.ports) do redis.call('HSET', pkey(h), p, r.key) end
  for _, d in ipairs(r.devs) do redis.call('HSET', dkey(h), d, r.key) end
  -- The preemptor has what was held for it there.
  if info(h).held_for == r.job then
    redis.call('HDEL', hkey(h), 'held_for')
    info(h).held_for = false
  end
end
-- Each host's use, once per host and dimension for the whole commit.
for h, w in pairs(want) do
  for _, d in ipairs(dims) do
    if w[d] ~= 0 then redis.call('HINCRBY', hkey(h), d .. '_used', w[d]) end
  end
end
for j0, g in ipairs(req.g) do
  local members = {}
  for _, m in ipairs(g.members) do
    members[#members + 1] = hkey(m)
    if g.exclusive then redis.call('HSET', hkey(m), 'gang', g.job) end
    if info(m).held_for == g.job then
      redis.call('HDEL', hkey(m), 'held_for')
      info(m).held_for = false
    end
  end
  redis.call('HSET', gkey(j0 - 1), 'owner', g.job, 'name', g.name,
             'members', cjson.encode(members), 'exclusive', g.exclusive and '1' or '0')
  redis.call('SADD', KEYS[2], gkey(j0 - 1))
end
return {'ok', tostring(#req.r)}
