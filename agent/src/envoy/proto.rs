//! The Envoy rate-limit service's messages and gRPC plumbing, vendored from Envoy's
//! `envoy/service/ratelimit/v3/rls.proto` and `envoy/extensions/common/ratelimit/v3/ratelimit.proto`
//! (Apache-2.0) as prost-build and tonic-build would generate them (the same field numbers and
//! types; the fields Floodgate never reads or writes — dynamic metadata, quota, raw body — are left
//! out: prost skips unknown fields when decoding, so a peer sending them still decodes).
//!
//! Why vendored instead of the `envoy-types` crate: that crate compiles all of Envoy's API (about
//! 400 generated modules, 8 MB of Rust) to use one service and six messages, and asks for a newer
//! Rust than the workspace's; `protoc` is not needed either way.
#![allow(missing_docs, clippy::doc_markdown)]

use std::sync::Arc;
use std::task::{Context, Poll};

use tonic::codegen::{http, Body, BoxFuture, Service, StdError};

/// `envoy.service.ratelimit.v3.RateLimitRequest`.
#[derive(Clone, PartialEq, ::prost::Message)]
pub struct RateLimitRequest {
    #[prost(string, tag = "1")]
    pub domain: String,
    #[prost(message, repeated, tag = "2")]
    pub descriptors: Vec<RateLimitDescriptor>,
    #[prost(uint32, tag = "3")]
    pub hits_addend: u32,
}

/// `envoy.extensions.common.ratelimit.v3.RateLimitDescriptor`.
#[derive(Clone, PartialEq, ::prost::Message)]
pub struct RateLimitDescriptor {
    #[prost(message, repeated, tag = "1")]
    pub entries: Vec<Entry>,
    #[prost(message, optional, tag = "2")]
    pub limit: Option<RateLimitOverride>,
    #[prost(message, optional, tag = "3")]
    pub hits_addend: Option<UInt64Value>,
    #[prost(bool, tag = "4")]
    pub is_negative_hits: bool,
}

/// `RateLimitDescriptor.Entry`.
#[derive(Clone, PartialEq, Eq, Hash, ::prost::Message)]
pub struct Entry {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(string, tag = "2")]
    pub value: String,
}

/// `RateLimitDescriptor.RateLimitOverride`.
#[derive(Clone, Copy, PartialEq, Eq, ::prost::Message)]
pub struct RateLimitOverride {
    #[prost(uint32, tag = "1")]
    pub requests_per_unit: u32,
    #[prost(int32, tag = "2")]
    pub unit: i32,
}

/// `google.protobuf.UInt64Value`.
#[derive(Clone, Copy, PartialEq, Eq, ::prost::Message)]
pub struct UInt64Value {
    #[prost(uint64, tag = "1")]
    pub value: u64,
}

/// `google.protobuf.Duration`.
#[derive(Clone, Copy, PartialEq, Eq, ::prost::Message)]
pub struct Duration {
    #[prost(int64, tag = "1")]
    pub seconds: i64,
    #[prost(int32, tag = "2")]
    pub nanos: i32,
}

impl Duration {
    /// From milliseconds.
    pub fn from_ms(ms: u64) -> Self {
        Duration {
            seconds: (ms / 1_000) as i64,
            nanos: ((ms % 1_000) * 1_000_000) as i32,
        }
    }

    /// In milliseconds (negative durations are 0).
    pub fn as_ms(&self) -> u64 {
        (self.seconds.max(0) as u64) * 1_000 + (self.nanos.max(0) as u64) / 1_000_000
    }
}

/// `envoy.config.core.v3.HeaderValue`.
#[derive(Clone, PartialEq, Eq, ::prost::Message)]
pub struct HeaderValue {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(string, tag = "2")]
    pub value: String,
}

/// `envoy.service.ratelimit.v3.RateLimitResponse`.
#[derive(Clone, PartialEq, ::prost::Message)]
pub struct RateLimitResponse {
    #[prost(enumeration = "Code", tag = "1")]
    pub overall_code: i32,
    #[prost(message, repeated, tag = "2")]
    pub statuses: Vec<DescriptorStatus>,
    #[prost(message, repeated, tag = "3")]
    pub response_headers_to_add: Vec<HeaderValue>,
    #[prost(message, repeated, tag = "4")]
    pub request_headers_to_add: Vec<HeaderValue>,
    /// What the next filters (and the route) read: `over_quota` in quota mode.
    #[prost(message, optional, tag = "6")]
    pub dynamic_metadata: Option<Struct>,
}

/// `google.protobuf.Struct`, as far as the agent writes one: fields by name.
#[derive(Clone, PartialEq, ::prost::Message)]
pub struct Struct {
    #[prost(btree_map = "string, message", tag = "1")]
    pub fields: std::collections::BTreeMap<String, Value>,
}

/// `google.protobuf.Value`: the kinds the agent writes (its other kinds, a oneof, are other tags).
#[derive(Clone, PartialEq, ::prost::Message)]
pub struct Value {
    #[prost(string, optional, tag = "3")]
    pub string_value: Option<String>,
    #[prost(bool, optional, tag = "4")]
    pub bool_value: Option<bool>,
}

/// `RateLimitResponse.Code`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, ::prost::Enumeration)]
#[repr(i32)]
pub enum Code {
    Unknown = 0,
    Ok = 1,
    OverLimit = 2,
}

/// `RateLimitResponse.RateLimit`.
#[derive(Clone, PartialEq, Eq, ::prost::Message)]
pub struct RateLimit {
    #[prost(string, tag = "3")]
    pub name: String,
    #[prost(uint32, tag = "1")]
    pub requests_per_unit: u32,
    #[prost(enumeration = "Unit", tag = "2")]
    pub unit: i32,
}

/// `RateLimitResponse.RateLimit.Unit`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, ::prost::Enumeration)]
#[repr(i32)]
pub enum Unit {
    Unknown = 0,
    Second = 1,
    Minute = 2,
    Hour = 3,
    Day = 4,
    Month = 5,
    Year = 6,
    Week = 7,
}

/// `RateLimitResponse.DescriptorStatus`.
#[derive(Clone, PartialEq, Eq, ::prost::Message)]
pub struct DescriptorStatus {
    #[prost(enumeration = "Code", tag = "1")]
    pub code: i32,
    #[prost(message, optional, tag = "2")]
    pub current_limit: Option<RateLimit>,
    #[prost(uint32, tag = "3")]
    pub limit_remaining: u32,
    #[prost(message, optional, tag = "4")]
    pub duration_until_reset: Option<Duration>,
}

/// The gRPC method's path.
pub const SHOULD_RATE_LIMIT: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// What answers ShouldRateLimit.
#[tonic::async_trait]
pub trait RateLimitService: Send + Sync + 'static {
    /// Decides one request.
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status>;
}

/// The service as tonic serves it (what tonic-build generates, for the one method).
#[derive(Debug)]
pub struct RateLimitServiceServer<T> {
    inner: Arc<T>,
}

impl<T> RateLimitServiceServer<T> {
    /// Serves `inner`.
    pub fn from_arc(inner: Arc<T>) -> Self {
        Self { inner }
    }
}

impl<T> Clone for RateLimitServiceServer<T> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<T> tonic::server::NamedService for RateLimitServiceServer<T> {
    const NAME: &'static str = "envoy.service.ratelimit.v3.RateLimitService";
}

struct ShouldRateLimitSvc<T>(Arc<T>);

impl<T: RateLimitService> tonic::server::UnaryService<RateLimitRequest> for ShouldRateLimitSvc<T> {
    type Response = RateLimitResponse;
    type Future = BoxFuture<tonic::Response<RateLimitResponse>, tonic::Status>;
    fn call(&mut self, request: tonic::Request<RateLimitRequest>) -> Self::Future {
        let inner = self.0.clone();
        Box::pin(async move { inner.should_rate_limit(request).await })
    }
}

impl<T, B> Service<http::Request<B>> for RateLimitServiceServer<T>
where
    T: RateLimitService,
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if req.uri().path() == SHOULD_RATE_LIMIT {
            let inner = self.inner.clone();
            return Box::pin(async move {
                let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::default());
                Ok(grpc.unary(ShouldRateLimitSvc(inner), req).await)
            });
        }
        Box::pin(async move {
            Ok(tonic::Status::unimplemented("only ShouldRateLimit is served here").into_http())
        })
    }
}

/// A ShouldRateLimit client (tests and the load generator; Envoy brings its own).
#[derive(Debug, Clone)]
pub struct RateLimitClient {
    inner: tonic::client::Grpc<tonic::transport::Channel>,
}

impl RateLimitClient {
    /// Over an open channel.
    pub fn new(channel: tonic::transport::Channel) -> Self {
        Self {
            inner: tonic::client::Grpc::new(channel),
        }
    }

    /// Connects to `http://host:port`.
    pub async fn connect(uri: String) -> Result<Self, tonic::transport::Error> {
        let channel = tonic::transport::Endpoint::from_shared(uri)?.connect().await?;
        Ok(Self::new(channel))
    }

    /// Calls ShouldRateLimit.
    pub async fn should_rate_limit(
        &mut self,
        request: RateLimitRequest,
    ) -> Result<RateLimitResponse, tonic::Status> {
        self.call(tonic::Request::new(request)).await
    }

    /// Calls ShouldRateLimit with the request's metadata (a `traceparent`, say).
    pub async fn call(
        &mut self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<RateLimitResponse, tonic::Status> {
        self.inner
            .ready()
            .await
            .map_err(|e| tonic::Status::unavailable(format!("service not ready: {e}")))?;
        let path = http::uri::PathAndQuery::from_static(SHOULD_RATE_LIMIT);
        let codec = tonic_prost::ProstCodec::default();
        Ok(self.inner.unary(request, path, codec).await?.into_inner())
    }
}
