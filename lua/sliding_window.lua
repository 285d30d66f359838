-- Floodgate sliding-window counter: estimate = previous * (1 - elapsed fraction of the window) + current.
--
-- State per (client key, rule): a hash {w = window index, c = current count, p = previous count} with
-- a TTL at the end of the window after the current one, so nothing needs a clean-up job.
--
-- sliding_window(key, now, limit, window, cost) reads the state and returns the verdict
-- (allowed, limit, remaining, reset_at_ms, retry_after_ms) and the write that would commit the cost.
-- check.lua calls it for every item first and commits only if every enforced item passes (or, for a
-- write-back of what agents admitted while Redis was away, unconditionally).
--
-- The maths is mirrored line for line by agent/src/algo/sliding_window.rs (the embedded store); a test
-- checks that both give the same answers for the same sequence.
-- The key's counts as of window `idx`: the stored window rolled forward (the current count becomes
-- the previous one after one window; both are gone after two).
local function sliding_window_state(key, now, window)
  local idx = math.floor(now / window)
  local v = redis.call('HMGET', key, 'w', 'c', 'p')
  local w = tonumber(v[1])
  local cur = tonumber(v[2]) or 0
  local prev = tonumber(v[3]) or 0
  if w == nil then
    cur, prev = 0, 0
  elseif w ~= idx then
    if w == idx - 1 then prev = cur else prev = 0 end
    cur = 0
  end
  return idx, cur, prev
end

local function sliding_window(key, now, limit, window, cost)
  local idx, cur, prev = sliding_window_state(key, now, window)

  local start = idx * window
  local elapsed = (now - start) / window
  local estimate = prev * (1 - elapsed) + cur
  local expire_at = start + 2 * window
  local commit = function()
    redis.call('HSET', key, 'w', idx, 'c', cur + cost, 'p', prev)
    redis.call('PEXPIREAT', key, expire_at)
  end
  if estimate + cost <= limit then
    local remaining = math.floor(limit - estimate - cost)
    if remaining < 0 then remaining = 0 end
    return { 1, limit, remaining, expire_at, 0 }, commit
  end

  local retry
  if cost > limit then
    retry = window
  elseif cur + cost <= limit then
    -- Still this window: wait until the previous window's weight has decayed enough.
    local frac = 1 - (limit - cur - cost) / prev
    retry = math.ceil(start + frac * window - now)
  else
    -- Next window: the current count becomes the previous one and decays from there.
    local frac = 1 - (limit - cost) / cur
    if frac < 0 then frac = 0 end
    retry = math.ceil(start + window + frac * window - now)
  end
  if retry < 1 then retry = 1 end
  local reset
  if cur > 0 then reset = expire_at elseif prev > 0 then reset = start + window else reset = now end
  local remaining = math.floor(limit - estimate)
  if remaining < 0 then remaining = 0 end
  return { 0, limit, remaining, reset, retry }, commit
end

-- sliding_window_write_back(key, now, window, units, target) adds units an agent admitted locally in
-- window `target` while Redis was away: to the current count if that window is the current one, to
-- the previous count if it is the one before (it still weighs on the estimate), else nowhere (its
-- weight is gone).
local function sliding_window_write_back(key, now, window, units, target)
  local idx, cur, prev = sliding_window_state(key, now, window)
  if target == idx then
    cur = cur + units
  elseif target == idx - 1 then
    prev = prev + units
  else
    return
  end
  redis.call('HSET', key, 'w', idx, 'c', cur, 'p', prev)
  redis.call('PEXPIREAT', key, idx * window + 2 * window)
end
