//! OpenTelemetry traces' flags, shared by the agent and the rules server.

/// OpenTelemetry traces: where spans go, under which service name, and how many new traces are kept.
#[derive(Debug, Clone, clap::Args)]
pub struct OtlpArgs {
    /// Export traces to this OTLP/HTTP collector (`http://collector:4318`; spans are POSTed as
    /// OTLP/JSON to `<endpoint>/v1/traces`): a span per check and per rules-API request. Off when unset.
    #[arg(long, env = "FLOODGATE_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,

    /// The spans' `service.name`.
    #[arg(long, env = "FLOODGATE_OTLP_SERVICE_NAME", default_value = "floodgate")]
    pub otlp_service_name: String,

    /// Share (0 to 1) of requests without a sampled trace context that start a recorded trace; a
    /// request whose `traceparent` says sampled is always recorded, one that says not sampled never.
    #[arg(long, env = "FLOODGATE_OTLP_SAMPLE_RATIO", default_value_t = 0.01, value_parser = parse_ratio)]
    pub otlp_sample_ratio: f64,
}

impl OtlpArgs {
    /// The tracer's configuration.
    pub fn config(&self) -> crate::otel::Config {
        crate::otel::Config {
            endpoint: self.otlp_endpoint.clone(),
            service_name: self.otlp_service_name.clone(),
            sample_ratio: self.otlp_sample_ratio,
        }
    }
}

fn parse_ratio(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(r) if (0.0..=1.0).contains(&r) => Ok(r),
        _ => Err(format!("{s:?}: a ratio from 0 to 1")),
    }
}
