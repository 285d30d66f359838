-- Floodgate check: one or more checks, each all or nothing, atomically, with Redis TIME as the clock.
--
-- The agent runs this script as sliding_window.lua .. token_bucket.lua .. check.lua (one script, one
-- SHA), so that one call can mix algorithms and still be all or nothing. Items come in groups (one
-- group per check: the agent may carry several concurrent checks for one shard in one call, which
-- spreads the script's fixed cost); within a group every item is evaluated first, and costs are
-- kept only if every enforced item passes, so a rejected check consumes nothing: a sliding window
-- counts an admitted cost at once and undoes it if the check fails, a token bucket writes its cost
-- only once the check passed. Items of rules in log mode (mode 0) are reported but never block the
-- others.
--
-- KEYS[i]  the item's state: fg:{<tag>}:<rule>:<bucket> (sliding window: the prefix of its window
--          hashes, which share its hash tag) or fg:{<tag>}:<rule>:k:<client key> (token bucket). On a
--          Redis Cluster one call carries keys of one hash tag only.
-- ARGV     the rules' parameters once per call, then 4 per item (callgrind: each argument costs Redis
--          ~1.1K instructions to parse and hand to Lua, so a call's items do not repeat them):
--          nspecs, then per spec: algorithm (1 sliding window | 2 token bucket), limit, window_ms,
--          burst; then per item: code, cost, target window, field (the client key), where
--          code = spec index (1-based) * 8 + mode * 2 + last (1 = the item ends its group).
--          mode 1 enforce | 0 log: check and commit as above.
--          mode 2 add: add the cost to the target window whatever the verdict (what agents admitted
--            locally while Redis was away; a token bucket may go below zero, a debt refilled first).
--          mode 3 take back: remove the cost from the target window (a check consumed it here but
--            was rejected on another shard); a token bucket gets the tokens back.
-- returns  5 integers per item: allowed (1 | 0), limit, remaining, reset_at_ms, retry_after_ms
--          (modes 2 and 3: 1, limit, units applied, now, count: for a sliding window's add, the
--          client's count in the target window afterwards, as flush.lua answers, from which the agent
--          learns what landed past the limit; 0 for a take-back and for a token bucket, whose debt
--          after a write-back would overstate it, the bucket having refilled meanwhile)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
local n = 0
local commits = {}
-- Admitted sliding-window items of the current group, to undo if the group fails: key, field, cost
-- and the count before, 4 slots per item in one table (a table per column was 3 more per call).
local undo, undos = {}, 0
local all_ok = true

local nspecs = tonumber(ARGV[1]) or -1
local base = 1 + nspecs * 4
if nspecs < 0 or #ARGV ~= base + #KEYS * 4 then
  return redis.error_reply('ERR floodgate: expected nspecs, 4 per spec and 4 per item')
end
for s = 1, nspecs do
  local algorithm = ARGV[s * 4 - 2]
  if algorithm ~= '1' and algorithm ~= '2' then
    return redis.error_reply('ERR floodgate: unknown algorithm ' .. tostring(algorithm))
  end
end

local last_spec, algorithm, limit, window, burst = nil, nil, nil, nil, nil
for i = 1, #KEYS do
  local a = base + (i - 1) * 4
  local code = tonumber(ARGV[a + 1]) or 0
  local spec = math.floor(code / 8)
  if spec < 1 or spec > nspecs then
    return redis.error_reply('ERR floodgate: item ' .. i .. ' names no spec')
  end
  -- The spec's arguments, parsed when the spec differs from the previous item's (no tables: a
  -- table per call costs more than it saves on a one-item call).
  if spec ~= last_spec then
    local b = spec * 4 - 2
    last_spec = spec
    algorithm, limit, window, burst = ARGV[b], tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3])
  end
  local cost = tonumber(ARGV[a + 2])
  local mode = math.floor(code / 2) % 4
  local last = code % 2
  local field = ARGV[a + 4]
  if mode == 2 or mode == 3 then
    local target = tonumber(ARGV[a + 3])
    local units = cost
    if mode == 3 then units = -cost end
    local applied, count = 0, 0
    if algorithm == '1' then
      applied, count = sliding_window_adjust(KEYS[i], field, now, window, units, target)
      if mode == 3 then count = 0 end
    elseif mode == 2 then
      local _, commit = token_bucket(KEYS[i], now, limit, window, burst, cost)
      commit()
      applied = cost
    else
      token_bucket_give_back(KEYS[i], now, limit, window, burst, cost)
      applied = -cost
    end
    out[n + 1], out[n + 2], out[n + 3], out[n + 4], out[n + 5] = 1, limit, applied, now, count
  elseif algorithm == '1' then
    local ok, remaining, reset, retry, key, was = sliding_window(KEYS[i], field, now, limit, window, cost)
    out[n + 1], out[n + 2], out[n + 3], out[n + 4], out[n + 5] = ok, limit, remaining, reset, retry
    if ok == 1 then
      undo[undos + 1], undo[undos + 2], undo[undos + 3], undo[undos + 4] = key, field, cost, was
      undos = undos + 4
    elseif mode == 1 then
      all_ok = false
    end
  else
    local verdict, commit = token_bucket(KEYS[i], now, limit, window, burst, cost)
    out[n + 1], out[n + 2], out[n + 3], out[n + 4], out[n + 5] = verdict[1], verdict[2], verdict[3], verdict[4], verdict[5]
    if verdict[1] == 1 then
      commits[#commits + 1] = commit
    elseif mode == 1 then
      all_ok = false
    end
  end
  n = n + 5
  if last == 1 then
    if all_ok then
      for _, commit in ipairs(commits) do commit() end
    else
      for u = 1, undos, 4 do sliding_window_undo(undo[u], undo[u + 1], undo[u + 2], undo[u + 3]) end
    end
    commits = {}
    undos = 0
    all_ok = true
  end
end
return out
