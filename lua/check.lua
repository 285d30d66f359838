-- Floodgate check: one or more checks, each all or nothing, atomically, with Redis TIME as the clock.
--
-- The agent runs this script as sliding_window.lua .. token_bucket.lua .. concurrency.lua ..
-- quota.lua .. check.lua (one script, one SHA), so that one call can mix algorithms and still be all or nothing. Items come in groups (one
-- group per check: the agent may carry several concurrent checks for one shard in one call, which
-- spreads the script's fixed cost); within a group every item is evaluated first, and costs are
-- kept only if every enforced item passes, so a rejected check consumes nothing: a sliding window
-- counts an admitted cost at once and undoes it if the check fails, a token bucket writes its cost
-- only once the check passed. Items of rules in log mode (mode 0) are reported but never block the
-- others.
--
-- KEYS     every key the script touches, in item order: a sliding window's two window hashes,
--          fg:{<tag>}:<rule>/<bucket>:w0 and :w1 (even and odd windows); a quota's period hash,
--          fg:{<tag>}:<rule>/<bucket>:q<period start>; a token bucket's hash,
--          fg:{<tag>}:<rule>/k/<client key>; a concurrency rule's leases,
--          fg:{<tag>}:<rule>/c/<client key>. On a Redis Cluster one call carries keys of one hash
--          tag only.
-- ARGV     9 per item: algorithm (1 sliding window | 2 token bucket | 3 concurrency | 4 quota),
--          limit, window_ms (concurrency: the lease time; quota: its period's end, Unix ms), burst
--          (quota: its period's start), cost, mode, target window (concurrency: the lease id;
--          quota: the period's start), field (the client key), last (1 = the item ends its group).
--          mode 1 enforce | 0 log: check and commit as above.
--          mode 2 add: add the cost to the target window whatever the verdict (what agents admitted
--            locally while Redis was away; a token bucket may go below zero, a debt refilled first).
--          mode 3 take back: remove the cost from the target window (a check consumed it here but
--            was rejected on another shard); a token bucket gets the tokens back.
--          mode 4 peek: the verdict for the cost, nothing written, never blocks the group.
--          mode 5 charge: the cost counted whatever the verdict (a sliding window past its limit,
--            a token bucket below zero); answers the state after, allowed whether still within the
--            limit; never blocks the group and is never undone by it.
--          Quota (its key the hash of the period starting at `target`, or holding now): modes 1
--            and 0 count the cost if it fits (only if the group passes), 4 peeks, 5 charges, 2 and
--            3 add and take back.
--          Concurrency: modes 1 and 0 acquire the lease `target` (taken only if the group passes),
--            4 peeks, 3 (take back) and 6 release the lease `target`, 7 releases `cost` units of
--            whole leases by count, 2 takes the lease `target` whatever the limit (renewed if held);
--            a release never blocks the group.
-- returns  5 integers per item: allowed (1 | 0), limit, remaining, reset_at_ms, retry_after_ms
--          (modes 2 and 3: 1, limit, units applied, now, count: for a sliding window's add, the
--          client's count in the target window afterwards, as flush.lua answers, from which the agent
--          learns what landed past the limit; for a concurrency add, the units held after it, or 0 if
--          the lease was held already; 0 for a take-back and for a token bucket, whose debt
--          after a write-back would overstate it, the bucket having refilled meanwhile). An add or a
--          take-back that Redis refuses (its key holds another type) does not stop the call: the
--          entry answers -1 as its first figure, nothing of it applied, and the agent drops it, so
--          one bad entry never holds back a write-back's others (each is its own pcall).
-- One add (mode 2) or take-back (mode 3): the units applied and, for a sliding window's add, the
-- target window's count after it. `key2` is a sliding window's odd-window hash.
local function adjust(key, key2, algorithm, mode, field, now, limit, window, burst, cost, target)
  if algorithm == '4' then
    -- A quota's add or take-back: into the period whose hash is `key`, which ends at `window`.
    local units = cost
    if mode == '3' then units = -cost end
    local count = quota_adjust(key, field, window, units)
    if mode == '3' then count = 0 end
    return units, count
  end
  if algorithm == '3' then
    -- A concurrency take-back frees the lease `target` (the string as sent: a 64-bit id is not a
    -- Lua number); an add takes it (a lease the fallback granted while the store was away), for
    -- `window` ms from now, and answers the units held after it (0 if it was held already).
    if mode == '3' then
      concurrency_release(key, now, limit, cost, target)
      return cost, 0
    end
    return cost, concurrency_take(key, now, window, cost, target)
  end
  if algorithm == '1' then
    local units = cost
    if mode == '3' then units = -cost end
    local applied, count = sliding_window_adjust(key, key2, field, now, window, units, tonumber(target))
    if mode == '3' then count = 0 end
    return applied, count
  elseif mode == '2' then
    local _, commit = token_bucket(key, now, limit, window, burst, cost)
    commit()
    return cost, 0
  end
  token_bucket_give_back(key, now, limit, window, burst, cost)
  return -cost, 0
end

-- A malformed call (the agent never sends one) is refused before anything is written: nine
-- arguments per item, a known algorithm each, and the keys its items take.
if #ARGV % 9 ~= 0 then
  return redis.error_reply('ERR floodgate: ' .. #ARGV .. ' arguments, not 9 per item')
end
local wanted = 0
for a = 1, #ARGV, 9 do
  local algorithm = ARGV[a]
  if algorithm == '1' then
    wanted = wanted + 2
  elseif algorithm == '2' or algorithm == '3' or algorithm == '4' then
    wanted = wanted + 1
  else
    return redis.error_reply('ERR floodgate: unknown algorithm ' .. tostring(algorithm))
  end
end
if wanted ~= #KEYS then
  return redis.error_reply('ERR floodgate: ' .. #KEYS .. ' keys where the items take ' .. wanted)
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
local n = 0
local commits = {}
-- Admitted sliding-window items of the current group, to undo if the group fails.
local undo_keys, undo_fields, undo_costs, undo_was, undos = {}, {}, {}, {}, 0
-- Where the current group's admitted items put their remaining, and their costs: if the group
-- fails they took nothing, and say so (remaining + cost).
local admitted_at, admitted_cost, admitted = {}, {}, 0
local all_ok = true

-- An item whose write waits for its group (a token bucket's, a quota's, a lease): admitted, its
-- write runs if the group passes (and its remaining, at `at`, gets its cost back if not); an
-- enforced one denied fails the group.
local function defer(allowed, commit, mode, at, cost)
  if allowed == 1 then
    admitted = admitted + 1
    admitted_at[admitted], admitted_cost[admitted] = at, cost
    commits[#commits + 1] = commit
  elseif mode == '1' then
    all_ok = false
  end
end

-- Keys taken by the items so far: a sliding window takes two, every other item one.
local k = 0
for i = 1, #ARGV / 9 do
  local a = (i - 1) * 9
  local algorithm = ARGV[a + 1]
  local key, key2 = KEYS[k + 1], nil
  if algorithm == '1' then
    key2 = KEYS[k + 2]
    k = k + 2
  else
    k = k + 1
  end
  local limit = tonumber(ARGV[a + 2])
  local window = tonumber(ARGV[a + 3])
  local cost = tonumber(ARGV[a + 5])
  local mode = ARGV[a + 6]
  local field = ARGV[a + 8]
  if algorithm == '4' and mode ~= '2' and mode ~= '3' then
    -- A quota: its period's hash is `key`, and the period ends at ARGV[a + 3] (the agent's calendar).
    local period_end = window
    local v
    if mode == '4' then
      v = quota_peek(key, field, now, limit, period_end, cost)
    elseif mode == '5' then
      v = quota_charge(key, field, now, limit, period_end, cost)
    else
      local commit
      v, commit = quota(key, field, now, limit, period_end, cost)
      defer(v[1], commit, mode, n + 3, cost)
    end
    out[n + 1], out[n + 2], out[n + 3], out[n + 4], out[n + 5] = v[1], v[2], v[3], v[4], v[5]
  elseif algorithm == '3' and mode ~= '2' and mode ~= '3' then
    local v
    if mode == '6' or mode == '7' then
      local id = false
      if mode == '6' then id = ARGV[a + 7] end
      v = concurrency_release(key, now, limit, cost, id)
    elseif mode == '4' or mode == '5' then
      v = concurrency_peek(key, now, limit, cost)
    else
      local commit
      v, commit = concurrency_acquire(key, now, limit, window, cost, ARGV[a + 7])
      defer(v[1], commit, mode, n + 3, cost)
    end
    out[n + 1], out[n + 2], out[n + 3], out[n + 4], out[n + 5] = v[1], v[2], v[3], v[4], v[5]
  elseif mode == '4' or mode == '5' then
    local burst = tonumber(ARGV[a + 4])
    if algorithm == '1' then
      local f = sliding_window_peek
      if mode == '5' then f = sliding_window_charge end
      out[n + 1], out[n + 3], out[n + 4], out[n + 5] = f(key, key2, field, now, limit, window, cost)
      out[n + 2] = limit
    else
      local f = token_bucket_peek
      if mode == '5' then f = token_bucket_charge end
      local v = f(key, now, limit, window, burst, cost)
      out[n + 1], out[n + 2], out[n + 3], out[n + 4], out[n + 5] = v[1], v[2], v[3], v[4], v[5]
    end
  elseif mode == '2' or mode == '3' then
    local ok, applied, count = pcall(adjust, key, key2, algorithm, mode, field, now, limit, window,
      tonumber(ARGV[a + 4]), cost, ARGV[a + 7])
    if ok then
      out[n + 1], out[n + 2], out[n + 3], out[n + 4], out[n + 5] = 1, limit, applied, now, count
    else
      out[n + 1], out[n + 2], out[n + 3], out[n + 4], out[n + 5] = -1, limit, 0, now, 0
    end
  elseif algorithm == '1' then
    local ok, remaining, reset, retry, written, was = sliding_window(key, key2, field, now, limit, window, cost)
    out[n + 1], out[n + 2], out[n + 3], out[n + 4], out[n + 5] = ok, limit, remaining, reset, retry
    if ok == 1 then
      admitted = admitted + 1
      admitted_at[admitted], admitted_cost[admitted] = n + 3, cost
      undos = undos + 1
      undo_keys[undos], undo_fields[undos], undo_costs[undos], undo_was[undos] = written, field, cost, was
    elseif mode == '1' then
      all_ok = false
    end
  else
    local verdict, commit = token_bucket(key, now, limit, window, tonumber(ARGV[a + 4]), cost)
    out[n + 1], out[n + 2], out[n + 3], out[n + 4], out[n + 5] = verdict[1], verdict[2], verdict[3], verdict[4], verdict[5]
    defer(verdict[1], commit, mode, n + 3, cost)
  end
  n = n + 5
  if ARGV[a + 9] == '1' then
    if all_ok then
      for _, commit in ipairs(commits) do commit() end
    else
      for u = 1, undos do sliding_window_undo(undo_keys[u], undo_fields[u], undo_costs[u], undo_was[u]) end
      for u = 1, admitted do
        local at = admitted_at[u]
        out[at] = math.min(out[at] + admitted_cost[u], out[at - 1])
      end
    end
    commits = {}
    admitted = 0
    undos = 0
    all_ok = true
  end
end
return out
