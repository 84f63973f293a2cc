-- Acquire or renew the scheduler leader lease.
-- KEYS[1] leader key, KEYS[2] epoch key; ARGV[1] scheduler id, ARGV[2] ttl in ms
-- A new holder takes a new epoch (INCR), so every write of the previous holder is refused.
-- Returns the holder's epoch, or 0 when another scheduler holds the lease.
local holder = redis.call('GET', KEYS[1])
if holder then
  local id, epoch = string.match(holder, '^(.*):(%d+)$')
  if id == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return tonumber(epoch)
  end
  return 0
end
local epoch = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. epoch, 'PX', ARGV[2])
return epoch
