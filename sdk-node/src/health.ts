/**
 * Whether a client reaches its agent: the {@link Health} it reports, and the warnings it logs when
 * connection attempts fail and when the agent is reachable again. An unreachable agent is otherwise
 * silent: every call answers by the fail policy (open: allowed, with no headers), which looks
 * exactly like a limiter with nothing to say.
 */

/** A client's view of its agent, for a service's health or readiness endpoint. */
export interface Health {
  /** Whether the client holds a live connection to the agent right now. */
  connected: boolean;
  /**
   * The agent's socket in use, or tried last (a client given no path looks it up again on each
   * attempt: see `defaultSocketPath`).
   */
  path: string;
  /** Why the last connection attempt failed or the last connection ended; null once connected. */
  lastError: string | null;
  /** Connection attempts that failed since the last connection was made. */
  failedAttempts: number;
  /**
   * Calls the SDK answered by itself (a fail-closed rule, the fail policy or the fallback limit), not
   * the agent, since the client started: the agent was unreachable, late, or could not answer.
   */
  failPolicyAnswers: number;
  /**
   * The agent's fail-closed rules the client knows (its last list, kept while the agent is away):
   * checks touching them are denied when the agent cannot answer. 0 before any list.
   */
  failClosedRules: number;
  /** The rule set version of that list (0 for a rules file); absent before any list. */
  rulesVersion?: number;
}

/**
 * At most one "cannot reach the agent" warning per client in this many ms: the client retries every
 * 10 ms to 1 s while the agent is away, so an outage would otherwise log up to 100 lines a second
 * per process.
 */
export const WARN_EVERY_MS = 10_000;

/** @internal The connection state behind {@link Health}, and its log lines. */
export class Reachability {
  path: string;
  lastError: string | null = null;
  failedAttempts = 0;
  private lastWarning: number | null = null;
  private suppressed = 0;
  // Whether this outage was logged: "reachable again" answers a warning someone may have seen, and
  // is not logged for an outage no line announced (its attempts are counted in the next warning).
  private announced = false;

  constructor(
    path: string,
    private readonly fail: string,
    private readonly logger: { warn(message: string): void } | null,
    private readonly now: () => number = () => performance.now(),
  ) {
    this.path = path;
  }

  /** A connection attempt to `path` failed. */
  failed(path: string, error: string): void {
    this.path = path;
    this.lastError = error;
    this.failedAttempts++;
    const now = this.now();
    if (this.lastWarning !== null && now - this.lastWarning < WARN_EVERY_MS) {
      this.suppressed++;
      return;
    }
    this.lastWarning = now;
    const more = this.suppressed
      ? ` (${this.suppressed} more failed attempts not logged since the last warning)`
      : "";
    this.suppressed = 0;
    this.announced = true;
    this.logger?.warn(`floodgate: cannot reach the agent at ${path}: ${error}; answering by fail policy ${this.fail}${more}`);
  }

  /** A connection to `path` was made (its Hello answered). */
  connected(path: string): void {
    this.path = path;
    this.lastError = null;
    const failed = this.failedAttempts;
    this.failedAttempts = 0;
    if (!this.announced) return;
    this.announced = false;
    // A warning, as the line it answers: whoever sees one must see the other.
    this.logger?.warn(`floodgate: agent reachable again at ${path} (after ${failed} failed attempts)`);
  }

  /**
   * The live connection ended. Not logged: the client reconnects at once, and only if that fails is
   * there something to say.
   */
  lost(error: string): void {
    this.lastError = error;
  }
}

/** strerror's words for the errors a connection attempt meets, as the other SDKs say them. */
const ERRNO: Record<string, string> = {
  ENOENT: "No such file or directory",
  ECONNREFUSED: "Connection refused",
  EACCES: "Permission denied",
  ENOTSOCK: "Socket operation on non-socket",
  ECONNRESET: "Connection reset by peer",
  EPIPE: "Broken pipe",
};

/** @internal A socket error as the warning says it. */
export function describeError(e: Error): string {
  const code = (e as NodeJS.ErrnoException).code;
  return (code !== undefined && ERRNO[code]) || e.message;
}
