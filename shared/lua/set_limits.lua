-- Replace the quotas and token limits reserve.lua enforces with the leader's, as folded
-- from the log's admin events (shared/limits.py redis_fields), fenced like every write.
-- KEYS[1] the fencing epoch; KEYS[2] the limits hash.
-- ARGV[1] the caller's epoch; ARGV[2] JSON {field: value}.
-- Returns {"ok", n fields} or {"stale_epoch", current}.
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) ~= current then
  return {'stale_epoch', tostring(current)}
end
local fields = cjson.decode(ARGV[2])
redis.call('DEL', KEYS[2])
local n = 0
for k, v in pairs(fields) do
  redis.call('HSET', KEYS[2], k, v)
  n = n + 1
end
return {'ok', tostring(n)}
