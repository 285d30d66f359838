/**
 * Express (and Connect-style) middleware: asks the agent once per request, sets
 * `X-RateLimit-Limit`, `-Remaining` and `-Reset` on every response an enforced rule applied to, and
 * answers a rejection with 429, `Retry-After` (whole seconds, rounded up, at least 1) and
 * `{"error":"rate_limited","retryAfter":N}`. Log-mode rules never block and never show in the
 * headers. When the agent cannot answer, the route's `failFor` policy decides if it has one; else a
 * fail-closed rule of the agent's that the request falls under denies it (429 with that rule's
 * limit in the headers); else the client's fail policy decides (open by default: the request passes
 * without headers). At a `chargeHeaders` or `chargeWith` endpoint the request is a peek of cost 0,
 * and the cost the response reports in its header (or the function gives) is charged once the
 * response is finished (`res.on("finish")`). On an agent that speaks protocol version 3 every check
 * carries a fresh lease; when a concurrency rule holds it, it is released (same attributes, cost and
 * lease, mode release) once the response is finished or its connection closed, whichever first:
 * after a normal answer, a handler's error, a streamed body, or a client that went away. A check
 * whose answer is not the agent's (late, connection lost mid-call) is released the same way, as a
 * precaution: the agent may still have taken its lease. The request's `traceparent` header, when it
 * has one, goes with its check, charge and release (protocol version 5; an invalid one is ignored).
 * Every request it lets through gets `req.floodgate` ({@link FloodgateRequestState}): with
 * `overQuota`, the rules whose limit it is past in quota mode (protocol version 6), also named in
 * the response's `X-RateLimit-Over-Quota`.
 *
 * The endpoint is the matched route when Express knows it, i.e. when the middleware is mounted on a
 * route (`app.get("/items/:id", limit, handler)` checks `/items/:id`, with the router's mount path
 * in front); mounted with `app.use(limit)` it runs before routing and checks the request path as
 * Express's router matches it, so that every spelling Express routes to a handler counts as one
 * endpoint: lower-cased unless the app has `case sensitive routing`, one trailing slash dropped
 * unless it has `strict routing` (`/Login` and `/login/` reach `app.get("/login")` by default). The
 * router matches the path as sent, neither percent-decoded (`/%6Cogin` is not `/login` to it, only
 * route parameters are decoded) nor with `//` collapsed, so neither is done here.
 */

import type { IncomingMessage, ServerResponse } from "node:http";

import type { Client } from "./client";
import {
  leaveState,
  Limiter,
  stripQuery,
  type FloodgateRequestState,
  type LimitOutcome,
  type RateLimitOptions,
  type RequestView,
} from "./http";

/** The parts of an Express request the middleware reads (structural: no dependency on express). */
export interface ExpressLikeRequest extends IncomingMessage {
  /** Express: the path below the mount point. */
  path?: string;
  /** Express: the router's mount path. */
  baseUrl?: string;
  /** Express: the URL as received, query included. */
  originalUrl?: string;
  /** Express: the matched route, inside a route's handlers. */
  route?: { path?: unknown };
  /** Express: the app, whose settings say how its router matches paths. */
  app?: { enabled?(setting: string): boolean };
  /**
   * Set by the middleware on every request it lets through: the rules the request is past in
   * quota mode (`req.floodgate.overQuota`).
   */
  floodgate?: FloodgateRequestState | null;
}

/**
 * The parts of an Express response a `chargeWith` function may read (structural: Express's
 * `Response` is one; write the function for `express.Request` and `express.Response` if you like).
 */
export interface ExpressLikeResponse extends ServerResponse {
  /** Express: what the handlers left for later middleware (`res.locals.tokens = 1500`). */
  // eslint-disable-next-line @typescript-eslint/no-explicit-any
  locals?: Record<string, any>;
}

/** The Express middleware's options: `chargeWith` functions take Express's `(req, res)`. */
export type ExpressOptions = RateLimitOptions<ExpressLikeRequest, ExpressLikeResponse>;

/** An Express/Connect middleware. */
export type ExpressMiddleware = (req: ExpressLikeRequest, res: ServerResponse, next: (err?: unknown) => void) => void;

/** How an Express router matches paths: its `caseSensitive` and `strict` options. */
export interface ExpressRouting {
  caseSensitive: boolean;
  strict: boolean;
}

/** The app's routing settings; undefined for a request that is not Express's (Connect, plain Node). */
function expressRouting(req: ExpressLikeRequest): ExpressRouting | undefined {
  const app = req.app;
  if (typeof app?.enabled !== "function") return undefined;
  return { caseSensitive: app.enabled("case sensitive routing"), strict: app.enabled("strict routing") };
}

/**
 * A path as an Express router with these settings matches it: lower-cased unless case-sensitive,
 * without one trailing slash (never `/` itself) unless strict. Nothing else: the router matches
 * the path as sent, percent-escapes and `//` included.
 */
export function expressRoutedPath(path: string, routing: ExpressRouting): string {
  const p = routing.caseSensitive ? path : path.toLowerCase();
  return !routing.strict && p.length > 1 && p.endsWith("/") ? p.slice(0, -1) : p;
}

/**
 * What the extractors see of an Express request: the matched route (the mount path as Express
 * matched it in front), else the path as Express's router matches it (see the module's comment).
 */
export function expressView(req: ExpressLikeRequest): RequestView {
  const routePath = req.route?.path;
  const routing = expressRouting(req);
  const path = stripQuery(req.originalUrl ?? req.url ?? "/") || "/";
  // baseUrl is the mount path as the request spelled it (`/API` for `app.use("/api", router)`).
  const base = req.baseUrl ?? "";
  return {
    headers: req.headers,
    rawHeaders: req.rawHeaders,
    // The socket's peer, not `req.ip`: Express's `trust proxy` takes that from X-Forwarded-For,
    // which only our own `trustProxies` may believe.
    remoteAddress: req.socket?.remoteAddress,
    route:
      typeof routePath === "string"
        ? `${routing && !routing.caseSensitive ? base.toLowerCase() : base}${routePath}`
        : undefined,
    path: routing ? expressRoutedPath(path, routing) : path,
    native: req,
  };
}

/** Writes the outcome: headers always, the 429 on a rejection. Returns whether the request goes on. */
export function applyToNodeResponse(res: ServerResponse, outcome: LimitOutcome): boolean {
  if (res.headersSent) return !outcome.reject;
  for (const [name, value] of outcome.headers) res.setHeader(name, value);
  if (!outcome.reject) return true;
  res.statusCode = 429;
  res.setHeader("Retry-After", String(outcome.reject.retryAfter));
  res.setHeader("Content-Type", "application/json");
  res.setHeader("Content-Length", Buffer.byteLength(outcome.reject.body));
  res.end(outcome.reject.body);
  return false;
}

/**
 * The middleware.
 *
 * ```ts
 * const client = await Client.connect(); // $FLOODGATE_SOCKET, else the agent's default socket
 * const limit = floodgateExpress(client, { userHeader: "x-authenticated-user", trustProxies: ["10.0.0.0/8"] });
 * app.get("/api/search", limit, search);   // endpoint "/api/search"
 * ```
 *
 * Throws at once if a `trustProxies` entry is not an address or CIDR block.
 */
export function floodgateExpress(client: Client, options: ExpressOptions = {}): ExpressMiddleware {
  const limiter = new Limiter(client, options);
  return (req, res, next) => {
    // Every request that goes on finds req.floodgate, over quota or not.
    const pass = (overQuota: readonly string[]) => {
      leaveState(req, overQuota);
      next();
    };
    let view: RequestView;
    try {
      view = expressView(req);
    } catch {
      pass([]);
      return;
    }
    limiter.decide(view).then(
      (outcome) => {
        // First, whatever happens next: a held lease is given back when this response is done.
        if (outcome.release) limiter.releaseWhenDone(res, outcome.release);
        let go = true;
        try {
          go = applyToNodeResponse(res, outcome);
        } catch {
          // A header value Node refuses (a rule id no agent sends): the request passes unlimited
          // rather than crash the process from an unhandled rejection.
        }
        const charge = outcome.charge;
        if (go && charge) {
          const { header, fn } = charge;
          limiter.chargeWhenDone(res, charge, fn ? () => fn(req, res) : () => res.getHeader(header ?? ""));
        }
        if (go) pass(outcome.overQuota);
      },
      () => pass([]),
    );
  };
}
