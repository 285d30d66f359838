/**
 * Fastify plugin and hook: the same behaviour as the Express middleware (headers of the binding
 * enforced rule on every response a rule applied to, 429 with `Retry-After` and the JSON body on a
 * rejection, and the same answers while the agent is away: `failFor`, the agent's fail-closed rules,
 * the client's fail policy). Fastify routes before `onRequest` hooks run, so the endpoint is the
 * matched route (`/items/:id`) for every request that matched one, whatever spelling its router
 * took there (`/LOGIN/` is `/login` under `caseSensitive: false` and `ignoreTrailingSlash`), and
 * the path for the others (answered 404 by Fastify). At a `chargeHeaders` or `chargeWith` endpoint
 * the request is a peek of cost 0, and the cost the reply reports in its header (or the function
 * gives from `(request, reply)`) is charged once the response is finished (the raw response's
 * `finish`, which also runs Fastify's `onResponse` hooks). On an agent that speaks protocol version
 * 3 every check carries a fresh lease; when a concurrency rule holds it, it is released once the
 * raw response is finished or closed, whichever first (a thrown handler error is answered, and so
 * finished, by Fastify; a client that went away closes it): once per request. A check whose answer
 * is not the agent's (late, connection lost mid-call) is released the same way, as a precaution.
 * The request's `traceparent` header, when it has one, goes with its check, charge and release
 * (protocol version 5; an invalid one is ignored). Every request it lets through gets
 * `request.floodgate` ({@link FloodgateRequestState}): with `overQuota`, the rules whose limit it is
 * past in quota mode (protocol version 6), also named in the reply's `X-RateLimit-Over-Quota`.
 *
 * ```ts
 * const client = await Client.connect(); // $FLOODGATE_SOCKET, else the agent's default socket
 * await app.register(floodgateFastify, { client, userHeader: "x-authenticated-user" });
 * ```
 */

import type { IncomingMessage, ServerResponse } from "node:http";

import type { Client } from "./client";
import { leaveState, Limiter, stripQuery, type FloodgateRequestState, type RateLimitOptions, type RequestView } from "./http";

/** The parts of a Fastify request the hook reads (structural: no dependency on fastify). */
export interface FastifyLikeRequest {
  headers: Record<string, string | string[] | undefined>;
  raw: IncomingMessage;
  url: string;
  /** Fastify ≥ 4.10: the matched route's options. */
  routeOptions?: { url?: string };
  /** Older Fastify: the matched route. */
  routerPath?: string;
  /**
   * Set by the hook on every request it lets through: the rules the request is past in quota mode
   * (`request.floodgate.overQuota`). The plugin declares it (`decorateRequest`), as Fastify asks.
   */
  floodgate?: FloodgateRequestState | null;
}

/** The parts of a Fastify reply the hook uses. */
export interface FastifyLikeReply {
  header(name: string, value: string): unknown;
  code(status: number): unknown;
  send(payload?: unknown): unknown;
  /** A header's value as the route set it (read at a `chargeHeaders` endpoint). */
  getHeader?(name: string): unknown;
  /** The Node response (its `finish` is when a `chargeHeaders` endpoint's cost is charged). */
  raw?: ServerResponse;
}

/** An `onRequest` hook. */
export type FastifyHook = (request: FastifyLikeRequest, reply: FastifyLikeReply) => Promise<unknown>;

/** The hook's options: `chargeWith` functions take Fastify's `(request, reply)`. */
export type FastifyOptions = RateLimitOptions<FastifyLikeRequest, FastifyLikeReply>;

/** Options of the plugin: the middleware's options and the client. */
export interface FastifyPluginOptions extends FastifyOptions {
  client: Client;
}

/** What the extractors see of a Fastify request. */
export function fastifyView(request: FastifyLikeRequest): RequestView {
  let route: string | undefined;
  try {
    route = request.routeOptions?.url ?? request.routerPath;
  } catch {
    route = undefined;
  }
  return {
    headers: request.headers,
    rawHeaders: request.raw?.rawHeaders,
    // The socket's peer, not `request.ip`: Fastify's `trustProxy` takes that from X-Forwarded-For,
    // which only our own `trustProxies` may believe.
    remoteAddress: request.raw?.socket?.remoteAddress,
    route: typeof route === "string" && route !== "" ? route : undefined,
    path: stripQuery(request.url ?? "/") || "/",
    native: request,
  };
}

/**
 * An `onRequest` hook, for a route or an instance: `app.addHook("onRequest", floodgateFastifyHook(client))`
 * or `{ onRequest: floodgateFastifyHook(client, { costs: { "/search": 5 } }) }` in a route's options.
 * Throws at once if a `trustProxies` entry is not an address or CIDR block.
 */
export function floodgateFastifyHook(client: Client, options: FastifyOptions = {}): FastifyHook {
  const limiter = new Limiter(client, options);
  return async (request, reply) => {
    const outcome = await limiter.decide(fastifyView(request));
    // The raw response's `finish` and `close` (its connection gone) end every request, whatever the
    // route did (a thrown error is answered by Fastify): one listener, one release.
    if (outcome.release && reply.raw) limiter.releaseWhenDone(reply.raw, outcome.release);
    for (const [name, value] of outcome.headers) reply.header(name, value);
    const charge = outcome.charge;
    if (charge && !outcome.reject && reply.raw) {
      // The raw response's `finish` is what runs Fastify's own onResponse hooks; listening to it
      // here serves the per-route hook as well as the plugin. reply.getHeader reads what the route
      // set with reply.header (Fastify writes those with writeHead, which the raw response keeps not).
      const raw = reply.raw;
      const { header = "", fn } = charge;
      limiter.chargeWhenDone(
        raw,
        charge,
        fn
          ? () => fn(request, reply)
          : () => (typeof reply.getHeader === "function" ? reply.getHeader(header) : raw.getHeader(header)),
      );
    }
    if (!outcome.reject) {
      leaveState(request, outcome.overQuota);
      return undefined;
    }
    reply.header("Retry-After", String(outcome.reject.retryAfter));
    reply.header("Content-Type", "application/json");
    reply.code(429);
    reply.send(outcome.reject.body);
    return reply;
  };
}

interface FastifyLikeInstance {
  addHook(name: "onRequest", hook: FastifyHook): unknown;
  decorateRequest?(name: string, value: unknown): unknown;
  hasRequestDecorator?(name: string): boolean;
}

/**
 * The plugin: `app.register(floodgateFastify, { client, ...options })`. It applies to every route of
 * the instance it is registered on (it does not open an encapsulation context, like a plugin wrapped
 * by `fastify-plugin`).
 */
export const floodgateFastify = Object.assign(
  function floodgateFastify(instance: FastifyLikeInstance, options: FastifyPluginOptions, done: (err?: Error) => void) {
    try {
      const { client, ...rest } = options;
      // Declared up front, so that Fastify's requests keep one shape (a property added later makes
      // V8 give them another); once, as a second registration on the instance finds it there.
      if (instance.decorateRequest && instance.hasRequestDecorator?.("floodgate") === false) {
        instance.decorateRequest("floodgate", null);
      }
      instance.addHook("onRequest", floodgateFastifyHook(client, rest));
      done();
    } catch (e) {
      done(e as Error);
    }
  },
  {
    [Symbol.for("skip-override")]: true,
    [Symbol.for("fastify.display-name")]: "floodgate",
    [Symbol.for("plugin-meta")]: { name: "floodgate", fastify: ">=4" },
  },
);
