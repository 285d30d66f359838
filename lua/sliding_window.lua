-- Floodgate sliding-window counter: estimate = previous * (1 - elapsed fraction of the window) + current.
--
-- Layout (BENCHMARKS.md measures it): counts live as fields of small hashes, one hash per
-- (rule, bucket of clients, window parity): window i's counts are in <prefix>:w<i % 2>, field = the
-- client key, value = units admitted in that window. The agent passes both hashes of the pair in
-- KEYS (k0, the even windows', then k1), so a script touches only keys it declared: a Cluster moving
-- the slot sends the call where those keys are (ASK, TRYAGAIN) and never has it create a hash the
-- other node still holds. A hash expires 1 ms before the end of the window after its own (when it
-- stops weighing on the estimate), so nothing needs a clean-up job and the hash of window i - 2 is
-- gone when window i, of the same parity, starts; a call that began in the window's last ms and
-- read the clock in its first (Redis expires keys by the call's start) finds it with less than a
-- window to live and deletes it (`sliding_window_key_now`). Redis keeps each small hash as one
-- compact listpack: ~20 B per client and window instead of ~100 B of per-key overhead for one key
-- per client.
--
-- sliding_window(k0, k1, field, now, limit, window, cost) counts the cost at once (HINCRBY returns
-- the count before it, so an admitted check costs two commands: the increment and a read of the
-- previous window), takes it back at once if the check is denied, and returns the verdict as
-- allowed (1 | 0), remaining, reset_at_ms, retry_after_ms, then the window hash and the count before
-- the increment, which sliding_window_undo needs to take an admitted cost back (check.lua undoes
-- every admitted item of a check that another item rejects). Plain values, no tables or closures:
-- this is the per-check hot path, and Lua allocations cost as much as the Redis commands here.
--
-- The maths is mirrored line for line by core/src/algo/sliding_window.rs (the embedded store); a test
-- checks that both give the same answers for the same sequence.
-- The hash of window `idx`: k0 for even windows, k1 for odd ones.
local function sliding_window_key(k0, k1, idx)
  if idx % 2 == 0 then return k0 end
  return k1
end

-- The hash of the window holding `now` (index `idx`), which may still hold window idx - 2's counts
-- in the first milliseconds of the window: Redis expires a key by the time its call started, and a
-- call that started just before the edge reads the clock after it. That hash has less than a window
-- to live (a current one has more), so it is deleted.
local function sliding_window_key_now(k0, k1, now, idx, window)
  local key = sliding_window_key(k0, k1, idx)
  if now - idx * window < 5 then
    local ttl = redis.call('PTTL', key)
    if ttl ~= -2 and ttl < window then
      redis.call('DEL', key)
    end
  end
  return key
end

-- When the hash of window `idx` expires: 1 ms before the end of the window after it.
local function sliding_window_expiry(idx, window)
  return (idx + 2) * window - 1
end

local function sliding_window_counts(k0, k1, field, now, idx, window)
  local cur = tonumber(redis.call('HGET', sliding_window_key_now(k0, k1, now, idx, window), field)) or 0
  local prev = tonumber(redis.call('HGET', sliding_window_key(k0, k1, idx - 1), field)) or 0
  return cur, prev
end

-- Adds `units` to the client's count in `key`, window `idx`'s hash. The hash's expiry is set by
-- whoever creates it, and a client whose count was 0 may be that creator; later writes leave it
-- alone (one call fewer).
local function sliding_window_add(key, field, idx, window, units, was)
  redis.call('HINCRBY', key, field, units)
  if was == 0 then
    redis.call('PEXPIREAT', key, sliding_window_expiry(idx, window))
  end
end

local function sliding_window_undo(key, field, cost, was)
  if was == 0 then
    redis.call('HDEL', key, field)
  else
    redis.call('HINCRBY', key, field, -cost)
  end
end

-- When `cost` could pass, in ms from `now` (at least 1), for counts `cur` and `prev` of the window
-- that started at `start`: a consume's denial and a peek's share it.
local function sliding_window_retry(start, now, limit, window, cost, cur, prev)
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
  return retry
end

local function sliding_window(k0, k1, field, now, limit, window, cost)
  local idx = math.floor(now / window)
  local key = sliding_window_key_now(k0, k1, now, idx, window)
  local cur = redis.call('HINCRBY', key, field, cost) - cost
  if cur == 0 then
    redis.call('PEXPIREAT', key, sliding_window_expiry(idx, window))
  end
  local prev = tonumber(redis.call('HGET', sliding_window_key(k0, k1, idx - 1), field)) or 0

  local start = idx * window
  local estimate = prev * (1 - (now - start) / window) + cur
  local expire_at = start + 2 * window
  if estimate + cost <= limit then
    local remaining = math.floor(limit - estimate - cost)
    if remaining < 0 then remaining = 0 end
    return 1, remaining, expire_at, 0, key, cur
  end
  sliding_window_undo(key, field, cost, cur)

  local retry = sliding_window_retry(start, now, limit, window, cost, cur, prev)
  local reset
  if cur > 0 then reset = expire_at elseif prev > 0 then reset = start + window else reset = now end
  local remaining = math.floor(limit - estimate)
  if remaining < 0 then remaining = 0 end
  return 0, remaining, reset, retry, key, cur
end

-- Adds (units > 0) or takes back (units < 0) units counted in window `target`: if that window still
-- weighs on the estimate (the current one or the one before), else nowhere. Used to write back what
-- agents admitted locally (fallback, batched counting) and to take back what a check consumed on one
-- shard when another shard rejected it. A take-back never goes below zero. Returns the units applied
-- and the client's count in window `target` afterwards.
local function sliding_window_adjust(k0, k1, field, now, window, units, target)
  local idx = math.floor(now / window)
  local key
  if target == idx then
    key = sliding_window_key_now(k0, k1, now, idx, window)
  elseif target == idx - 1 then
    key = sliding_window_key(k0, k1, target)
  else
    return 0, 0
  end
  local was = tonumber(redis.call('HGET', key, field)) or 0
  if units < 0 and -units > was then
    units = -was
  end
  if units == 0 then
    return 0, was
  end
  sliding_window_add(key, field, target, window, units, was)
  return units, was + units
end

-- A peek: what `cost` would do now, changing nothing (core/src/algo/sliding_window.rs
-- `sliding_window_peek`): allowed (1 | 0), remaining now (before any cost), reset_at_ms when the
-- counts weighing now are gone, retry_after_ms on a denial.
local function sliding_window_peek(k0, k1, field, now, limit, window, cost)
  local idx = math.floor(now / window)
  local cur, prev = sliding_window_counts(k0, k1, field, now, idx, window)
  local start = idx * window
  local estimate = prev * (1 - (now - start) / window) + cur
  local remaining = math.floor(limit - estimate)
  if remaining < 0 then remaining = 0 end
  local reset
  if cur > 0 then reset = start + 2 * window elseif prev > 0 then reset = start + window else reset = now end
  if estimate + cost <= limit then
    return 1, remaining, reset, 0
  end
  return 0, remaining, reset, sliding_window_retry(start, now, limit, window, cost, cur, prev)
end

-- A charge: `cost` counted whatever the limit says (`sliding_window_charge`): the state after it,
-- allowed (1 | 0) whether the key is still within its limit (committed either way), remaining
-- floored at 0, reset at the end of the window after this one.
local function sliding_window_charge(k0, k1, field, now, limit, window, cost)
  local idx = math.floor(now / window)
  local key = sliding_window_key_now(k0, k1, now, idx, window)
  local cur = redis.call('HINCRBY', key, field, cost)
  if cur == cost then
    redis.call('PEXPIREAT', key, sliding_window_expiry(idx, window))
  end
  local prev = tonumber(redis.call('HGET', sliding_window_key(k0, k1, idx - 1), field)) or 0
  local start = idx * window
  local estimate = prev * (1 - (now - start) / window) + cur
  local remaining = math.floor(limit - estimate)
  if remaining < 0 then remaining = 0 end
  if estimate <= limit then
    return 1, remaining, start + 2 * window, 0
  end
  -- Past the limit: when one unit could pass again.
  local _, _, _, retry = sliding_window_peek(k0, k1, field, now, limit, window, 1)
  if retry < 1 then retry = 1 end
  return 0, remaining, start + 2 * window, retry
end
