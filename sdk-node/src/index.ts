/**
 * `@floodgate/client`: ask the local Floodgate agent whether a request may pass.
 *
 * One {@link Client} per process holds one multiplexed Unix-socket connection to the agent; many
 * checks are in flight at once, each with its own request id. Every call resolves within its
 * timeout (default 10 ms): when the agent is unreachable or late it denies checks under the agent's
 * fail-closed rules (learnt from the agent, kept while it is away) and answers the others by its
 * fail policy, open (allow) by default, closed where configured; the client reconnects in the
 * background.
 *
 * - {@link Client}: `allow`, `check`, `checkAttributes`, `peek`, `charge`, `acquire`, `release`,
 *   `hold` (leases of concurrency rules), `reserve`, `reserveMeters`, `commit` (reservations,
 *   protocol version 6), `health`; a decision's `overQuota` and `overQuotaRules` say a rule in
 *   quota mode let the request through past its limit (protocol version 6); each call may carry the caller's W3C `traceparent` (protocol
 *   version 5). `new Client()`
 *   finds the agent with {@link defaultSocketPath} (`$FLOODGATE_SOCKET`, else
 *   `/run/floodgate/floodgate.sock`, else `$XDG_RUNTIME_DIR/floodgate/floodgate.sock`) on every
 *   connection attempt, and warns through `console.warn` (at most once every 10 s) while it cannot
 *   reach it.
 * - {@link floodgateExpress}: Express middleware; {@link floodgateFastify}: Fastify plugin. Both
 *   forward the request's `traceparent` header with its checks, and name the quota-mode rules a
 *   request is past in `X-RateLimit-Over-Quota` and `req.floodgate.overQuota`.
 * - The wire protocol (`encodeFrame`, `decodeFrame`) for tools and tests.
 */

export { Client, FloodgateError, newLeaseId } from "./client";
export type {
  Acquired,
  CallOptions,
  ClientConfig,
  ClientStats,
  FailPolicy,
  HoldResult,
  Lease,
  LocalLimit,
  Logger,
  Meter,
  Reservation,
  Reserved,
} from "./client";
export type { Health } from "./health";
export { DEFAULT_SOCKET, defaultSocketPath } from "./socket-path";
export { fromAgent } from "./decision";
export type { Decision, Degraded, Origin } from "./decision";
export {
  checkVersion,
  decodeFrame,
  encodeFrame,
  formatTraceparent,
  parseTraceparent,
  validateCheck,
  validateRuleId,
  validateTrace,
  ErrorCode,
  InvalidCheck,
  Kind,
  MAX_ATTRIBUTE,
  MAX_FRAME,
  MAX_ITEMS,
  MAX_KEY,
  MAX_LEASE,
  MAX_RULE_ID,
  MIN_VERSION,
  RESERVE_VERSION,
  TRACE_VERSION,
  VERSION,
} from "./protocol";
export type {
  Attributes,
  Body,
  Check,
  CheckVersion,
  DecodeResult,
  Frame,
  Item,
  ItemDecision,
  ItemMode,
  Source,
  TraceContext,
  Verdict,
} from "./protocol";
export { closing, endpointMatches, touches } from "./fail-modes";
export type { ClosedRule, FailModeList, ListedDimension } from "./fail-modes";
export {
  Cidr,
  bindingRule,
  clientIp,
  fnv1a64Hex,
  OVER_QUOTA_HEADER,
  rateLimitHeaders,
  retryAfterSeconds,
  routeName,
  wireSafe,
} from "./http";
export type {
  ChargeFunction,
  Extractor,
  FloodgateRequestState,
  LimitOutcome,
  RateLimitOptions,
  RequestView,
} from "./http";
export { floodgateExpress, expressRoutedPath, expressView } from "./express";
export type {
  ExpressLikeRequest,
  ExpressLikeResponse,
  ExpressMiddleware,
  ExpressOptions,
  ExpressRouting,
} from "./express";
export { floodgateFastify, floodgateFastifyHook, fastifyView } from "./fastify";
export type {
  FastifyHook,
  FastifyLikeReply,
  FastifyLikeRequest,
  FastifyOptions,
  FastifyPluginOptions,
} from "./fastify";
