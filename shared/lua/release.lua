-- Release reservations whose attempts have exited (confirmed by the worker, or the worker
-- was declared dead). Releasing an attempt that holds nothing changes nothing. When a
-- group's last reservation goes, the group and its hosts are free for another gang.
-- KEYS[1] the fencing epoch; KEYS[2] the set of held group keys;
-- KEYS[3+2k], KEYS[4+2k]: host hash, allocation hash of release k; then the limits-use
-- hash (redis_keys.LIMITS_USED), where the reservation's quota use ("u") and tokens
-- ("tok") go back; last, redis_keys.RELEASED_THROUGH. A reservation's ports
-- are released from the address port hash it recorded (pk), its devices from the device
-- hash it recorded (dk), as its group from its group key.
-- ARGV[1] the caller's epoch; ARGV[2] the log sequence through which the caller's fold
-- owes no release but these (0: not said); ARGV[k+3] the attempt key of release k
-- (k = 0 ..). RELEASED_THROUGH only rises: the checker reads it to tell a release still
-- owed from a leaked reservation.
-- Returns {"ok", released} or {"stale_epoch", current}.
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) ~= current then
  return {'stale_epoch', tostring(current)}
end
local dims = {'cpu', 'mem', 'disk', 'dev'}
local qdims = {'cpu', 'mem', 'dev'}
local released = 0
local UK = KEYS[#KEYS - 1]
-- What goes back, summed per host and per user or token counter, is written once each for
-- the whole call, as reserve.lua takes it: a release's calls into Redis were most of its
-- time, and every write is also a line of the append-only file.
local freed, back, order = {}, {}, {}
for k = 0, #ARGV - 3 do
  local host, alloc = KEYS[3 + 2 * k], KEYS[4 + 2 * k]
  local key = ARGV[k + 3]
  local held = redis.call('HGET', alloc, key)
  if held then
    local a = cjson.decode(held)
    redis.call('HDEL', alloc, key)
    local f = freed[host]
    if f == nil then
      f = {cpu = 0, mem = 0, disk = 0, dev = 0}
      freed[host] = f
      order[#order + 1] = host
    end
    for _, d in ipairs(dims) do f[d] = f[d] + a[d] end
    if a.u ~= nil then
      for _, d in ipairs(qdims) do
        if a[d] > 0 then
          local field = d .. ':' .. a.u
          back[field] = (back[field] or 0) + a[d]
        end
      end
    end
    if type(a.tok) == 'table' then
      for t, n in pairs(a.tok) do back['t:' .. t] = (back['t:' .. t] or 0) + n end
    end
    if type(a.ports) == 'table' and a.pk then
      for _, p in ipairs(a.ports) do
        if redis.call('HGET', a.pk, p) == key then redis.call('HDEL', a.pk, p) end
      end
    end
    if type(a.devs) == 'table' and a.dk then
      for _, d in ipairs(a.devs) do
        if redis.call('HGET', a.dk, d) == key then redis.call('HDEL', a.dk, d) end
      end
    end
    if a.group ~= '' and redis.call('HINCRBY', a.group, 'live', -1) <= 0 then
      local g = redis.call('HMGET', a.group, 'owner', 'members')
      for _, member in ipairs(cjson.decode(g[2] or '[]')) do
        if redis.call('HGET', member, 'gang') == g[1] then redis.call('HDEL', member, 'gang') end
      end
      redis.call('DEL', a.group)
      redis.call('SREM', KEYS[2], a.group)
    end
    released = released + 1
  end
end
for _, host in ipairs(order) do
  local f = freed[host]
  for _, d in ipairs(dims) do
    if f[d] ~= 0 then redis.call('HINCRBY', host, d .. '_used', -f[d]) end
  end
end
for field, n in pairs(back) do
  if redis.call('HINCRBY', UK, field, -n) <= 0 then redis.call('HDEL', UK, field) end
end
local through = tonumber(ARGV[2])
if through > tonumber(redis.call('GET', KEYS[#KEYS]) or '0') then
  redis.call('SET', KEYS[#KEYS], ARGV[2])
end
return {'ok', tostring(released)}
