/**
 * Where a client given no path finds the agent: the same places, in the same order, as the agent's
 * own default and every other Floodgate SDK.
 */

import * as fs from "node:fs";
import * as path from "node:path";

/**
 * The agent's default socket: under `/run` (root-owned), never in world-writable `/tmp`, where any
 * local user could bind the path first and answer "allowed" to every check.
 */
export const DEFAULT_SOCKET = "/run/floodgate/floodgate.sock";

/** The environment variable that names the agent's socket. */
export const SOCKET_ENV = "FLOODGATE_SOCKET";

/**
 * The agent's socket for a client given no path, looked up again on every connection attempt (so
 * an agent started after the app is still found):
 *
 * 1. `$FLOODGATE_SOCKET`, if set and not empty;
 * 2. else `/run/floodgate/floodgate.sock` if it exists (a system agent);
 * 3. else `$XDG_RUNTIME_DIR/floodgate/floodgate.sock` if `XDG_RUNTIME_DIR` is an absolute path and
 *    that file exists (an agent run by the user);
 * 4. else `/run/floodgate/floodgate.sock`: the path errors and logs name.
 *
 * Synchronous `stat`s: a few microseconds, once per connection attempt (at most every 10 ms while
 * the agent is away), never per call.
 */
export function defaultSocketPath(): string {
  const env = process.env[SOCKET_ENV];
  if (env) return env;
  if (fs.existsSync(DEFAULT_SOCKET)) return DEFAULT_SOCKET;
  const runtime = process.env.XDG_RUNTIME_DIR;
  // A relative XDG_RUNTIME_DIR is invalid per the XDG spec (and would depend on the app's cwd).
  if (runtime && path.isAbsolute(runtime)) {
    const user = path.join(runtime, "floodgate", "floodgate.sock");
    if (fs.existsSync(user)) return user;
  }
  return DEFAULT_SOCKET;
}
