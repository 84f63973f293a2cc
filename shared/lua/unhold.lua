-- Let go of hosts held for a preemptor that was not placed there (it ended, or could not
-- be placed once its victims had exited). Only its own holds are cleared.
-- KEYS[1] the fencing epoch; KEYS[2..] host hashes. ARGV[1] the caller's epoch; ARGV[2] the
-- preemptor's job id.
-- Returns {"ok", released} or {"stale_epoch", current}.
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) ~= current then
  return {'stale_epoch', tostring(current)}
end
local released = 0
for k = 2, #KEYS do
  if redis.call('HGET', KEYS[k], 'held_for') == ARGV[2] then
    redis.call('HDEL', KEYS[k], 'held_for')
    released = released + 1
  end
end
return {'ok', tostring(released)}
