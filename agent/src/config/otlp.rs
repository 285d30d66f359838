//! OpenTelemetry traces' flags, shared by the agent and the rules server, and OpenTelemetry's own
//! environment variables where no flag (or `FLOODGATE_OTLP_*`) is given.

/// OpenTelemetry traces: where spans go, under which service name, and how many new traces are kept.
#[derive(Debug, Clone, clap::Args)]
pub struct OtlpArgs {
    /// Export traces to this OTLP collector (`http://collector:4318`; spans are POSTed as
    /// OTLP/protobuf, or JSON per `OTEL_EXPORTER_OTLP_PROTOCOL`, to `<endpoint>/v1/traces`, or sent
    /// over OTLP/gRPC to `http://collector:4317` with `OTEL_EXPORTER_OTLP_PROTOCOL=grpc`): a span
    /// per check and per rules-API request. Unset: `OTEL_EXPORTER_OTLP_ENDPOINT`, else off.
    #[arg(long, env = "FLOODGATE_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,

    /// The spans' `service.name`. Unset: `OTEL_SERVICE_NAME`, else `service.name` in
    /// `OTEL_RESOURCE_ATTRIBUTES`, else `floodgate`.
    #[arg(long, env = "FLOODGATE_OTLP_SERVICE_NAME")]
    pub otlp_service_name: Option<String>,

    /// Share (0 to 1) of requests without a sampled trace context that start a recorded trace; a
    /// request whose `traceparent` says sampled is always recorded, one that says not sampled never.
    /// Unset: from `OTEL_TRACES_SAMPLER` (and `_ARG`), else 0.01.
    #[arg(long, env = "FLOODGATE_OTLP_SAMPLE_RATIO", value_parser = parse_ratio)]
    pub otlp_sample_ratio: Option<f64>,
}

/// The share of new traces recorded when neither a flag nor `OTEL_TRACES_SAMPLER` says.
pub const DEFAULT_SAMPLE_RATIO: f64 = 0.01;

impl OtlpArgs {
    /// The tracer's configuration: the flags, then OpenTelemetry's environment variables
    /// (`OTEL_EXPORTER_OTLP_ENDPOINT`, `_HEADERS`, `_TIMEOUT`, `_COMPRESSION`, `_PROTOCOL`,
    /// `_CERTIFICATE` and their `_TRACES_` forms, `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`,
    /// `OTEL_TRACES_SAMPLER` and `_ARG`), then the defaults. A variable that cannot be read is an
    /// error naming it.
    pub fn config(&self) -> Result<crate::otel::Config, String> {
        self.config_from(|k| std::env::var(k).ok().filter(|v| !v.trim().is_empty()))
    }

    fn config_from(&self, env: impl Fn(&str) -> Option<String>) -> Result<crate::otel::Config, String> {
        // The traces-only variable wins over the general one, as the specification says.
        let either = |traces: &str, general: &str| {
            env(traces)
                .map(|v| (traces.to_string(), v))
                .or_else(|| env(general).map(|v| (general.to_string(), v)))
        };
        let encoding = match either(
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ) {
            Some((name, v)) => match v.trim() {
                "http/json" => crate::otel::Encoding::Json,
                "http/protobuf" => crate::otel::Encoding::Protobuf,
                "grpc" => crate::otel::Encoding::Grpc,
                _ => return Err(format!("{name}={v:?}: http/json, http/protobuf or grpc")),
            },
            // OpenTelemetry's default, and an eighth of OTLP/JSON's bytes (BENCHMARKS.md).
            None => crate::otel::Encoding::Protobuf,
        };
        let endpoint = match (&self.otlp_endpoint, env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")) {
            (Some(e), _) => Some(e.clone()),
            // OTLP/gRPC has no path: the traces endpoint is the collector's address.
            (None, Some(url)) if encoding == crate::otel::Encoding::Grpc => Some(url),
            // The traces endpoint is the whole URL spans go to; ours appends `/v1/traces`.
            (None, Some(url)) => Some(
                url.trim_end_matches('/')
                    .strip_suffix("/v1/traces")
                    .ok_or_else(|| format!("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT={url:?}: Floodgate posts to <base>/v1/traces; give a URL ending in /v1/traces or set OTEL_EXPORTER_OTLP_ENDPOINT"))?
                    .to_string(),
            ),
            (None, None) => env("OTEL_EXPORTER_OTLP_ENDPOINT"),
        };
        let resource = match env("OTEL_RESOURCE_ATTRIBUTES") {
            Some(v) => key_values(&v).map_err(|e| format!("OTEL_RESOURCE_ATTRIBUTES: {e}"))?,
            None => Vec::new(),
        };
        let service_name = self
            .otlp_service_name
            .clone()
            .or_else(|| env("OTEL_SERVICE_NAME"))
            .or_else(|| {
                resource
                    .iter()
                    .find(|(k, _)| k == "service.name")
                    .map(|(_, v)| v.clone())
            })
            .unwrap_or_else(|| "floodgate".into());
        let sample_ratio = match self.otlp_sample_ratio {
            Some(r) => r,
            None => sampler_ratio(env("OTEL_TRACES_SAMPLER"), env("OTEL_TRACES_SAMPLER_ARG"))?,
        };
        let headers = match either("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS") {
            Some((name, v)) => key_values(&v).map_err(|e| format!("{name}: {e}"))?,
            None => Vec::new(),
        };
        let timeout = match either("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT") {
            Some((name, v)) => match v.trim().parse::<u64>() {
                Ok(ms) if ms > 0 => std::time::Duration::from_millis(ms),
                _ => return Err(format!("{name}={v:?}: a timeout in milliseconds")),
            },
            None => crate::otel::EXPORT_TIMEOUT,
        };
        let gzip = match either(
            "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION",
            "OTEL_EXPORTER_OTLP_COMPRESSION",
        ) {
            Some((name, v)) => match v.trim() {
                "gzip" => true,
                "none" => false,
                _ => return Err(format!("{name}={v:?}: gzip or none")),
            },
            None => false,
        };
        let certificate = either(
            "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE",
            "OTEL_EXPORTER_OTLP_CERTIFICATE",
        )
        .map(|(_, v)| std::path::PathBuf::from(v));
        Ok(crate::otel::Config {
            endpoint,
            service_name,
            sample_ratio,
            headers,
            timeout,
            gzip,
            encoding,
            resource,
            certificate,
        })
    }
}

/// `OTEL_TRACES_SAMPLER` (and its `_ARG`) as the share of new traces recorded. Floodgate's sampler
/// is always parent-based (a caller's sampled flag decides), so `always_on`, `always_off` and
/// `traceidratio` are taken as their `parentbased_` forms.
fn sampler_ratio(sampler: Option<String>, arg: Option<String>) -> Result<f64, String> {
    let Some(sampler) = sampler else {
        return Ok(DEFAULT_SAMPLE_RATIO);
    };
    match sampler
        .trim()
        .strip_prefix("parentbased_")
        .unwrap_or(sampler.trim())
    {
        "always_on" => Ok(1.0),
        "always_off" => Ok(0.0),
        "traceidratio" => match arg {
            None => Ok(1.0),
            Some(a) => parse_ratio(a.trim()).map_err(|e| format!("OTEL_TRACES_SAMPLER_ARG: {e}")),
        },
        other => Err(format!(
            "OTEL_TRACES_SAMPLER={other:?}: always_on, always_off or traceidratio (each also parentbased_)"
        )),
    }
}

/// `key=value,key=value` with percent-encoded values (W3C Baggage's form, as
/// `OTEL_EXPORTER_OTLP_HEADERS` and `OTEL_RESOURCE_ATTRIBUTES` are written).
fn key_values(text: &str) -> Result<Vec<(String, String)>, String> {
    text.split(',')
        .filter(|kv| !kv.trim().is_empty())
        .map(|kv| {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| format!("{kv:?} is not key=value"))?;
            let v = percent_decode(v.trim()).ok_or_else(|| format!("{kv:?}: a bad percent-encoding"))?;
            Ok((k.trim().to_string(), v))
        })
        .collect()
}

/// `%XX` escapes decoded; `None` for an escape that is not two hex digits, or bytes that are not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let escapes_ok = s
        .split('%')
        .skip(1)
        .all(|rest| rest.len() >= 2 && rest.as_bytes()[..2].iter().all(u8::is_ascii_hexdigit));
    if !escapes_ok {
        return None;
    }
    percent_encoding::percent_decode_str(s)
        .decode_utf8()
        .ok()
        .map(|v| v.into_owned())
}

fn parse_ratio(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(r) if (0.0..=1.0).contains(&r) => Ok(r),
        _ => Err(format!("{s:?}: a ratio from 0 to 1")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> OtlpArgs {
        OtlpArgs {
            otlp_endpoint: None,
            otlp_service_name: None,
            otlp_sample_ratio: None,
        }
    }

    fn with<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn opentelemetrys_variables_fill_what_no_flag_says() {
        let c = args()
            .config_from(with(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318"),
                (
                    "OTEL_EXPORTER_OTLP_HEADERS",
                    "authorization=Bearer%20abc,x-team=edge",
                ),
                ("OTEL_EXPORTER_OTLP_TIMEOUT", "2500"),
                ("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
                (
                    "OTEL_RESOURCE_ATTRIBUTES",
                    "service.name=from-resource,deployment.environment=prod",
                ),
                ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
                ("OTEL_TRACES_SAMPLER_ARG", "0.25"),
            ]))
            .unwrap();
        assert_eq!(c.endpoint.as_deref(), Some("http://collector:4318"));
        assert_eq!(
            c.headers,
            [
                ("authorization".into(), "Bearer abc".into()),
                ("x-team".into(), "edge".into())
            ]
        );
        assert_eq!(c.timeout, std::time::Duration::from_millis(2500));
        assert!(c.gzip);
        assert_eq!(c.encoding, crate::otel::Encoding::Protobuf);
        assert_eq!(c.service_name, "from-resource");
        assert_eq!(c.sample_ratio, 0.25);
        assert_eq!(c.resource[1], ("deployment.environment".into(), "prod".into()));
        // OTEL_SERVICE_NAME before the resource's; the traces-only forms before the general ones.
        let c = args()
            .config_from(with(&[
                ("OTEL_SERVICE_NAME", "svc"),
                ("OTEL_RESOURCE_ATTRIBUTES", "service.name=other"),
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://general:4318"),
                (
                    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                    "http://traces:4318/v1/traces",
                ),
                ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "a=1"),
                ("OTEL_EXPORTER_OTLP_HEADERS", "b=2"),
                ("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "none"),
                ("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip"),
                ("OTEL_TRACES_SAMPLER", "always_off"),
            ]))
            .unwrap();
        assert_eq!(c.service_name, "svc");
        assert_eq!(c.endpoint.as_deref(), Some("http://traces:4318"));
        assert_eq!(c.headers, [("a".into(), "1".into())]);
        assert!(!c.gzip);
        // Unset: OpenTelemetry's default.
        assert_eq!(c.encoding, crate::otel::Encoding::Protobuf);
        assert_eq!(c.sample_ratio, 0.0);
    }

    #[test]
    fn flags_win_and_nothing_set_means_off() {
        let mut a = args();
        a.otlp_endpoint = Some("http://flag:4318".into());
        a.otlp_service_name = Some("flag".into());
        a.otlp_sample_ratio = Some(0.5);
        let env = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://env:4318"),
            ("OTEL_SERVICE_NAME", "env"),
            ("OTEL_TRACES_SAMPLER", "always_on"),
        ];
        let c = a.config_from(with(&env)).unwrap();
        assert_eq!(
            (c.endpoint.as_deref(), c.service_name.as_str(), c.sample_ratio),
            (Some("http://flag:4318"), "flag", 0.5)
        );
        let c = args().config_from(with(&[])).unwrap();
        assert_eq!(c.endpoint, None);
        assert_eq!(
            (c.service_name.as_str(), c.sample_ratio),
            ("floodgate", DEFAULT_SAMPLE_RATIO)
        );
    }

    #[test]
    fn variables_that_cannot_be_read_are_refused_by_name() {
        for (k, v) in [
            ("OTEL_TRACES_SAMPLER", "jaeger_remote"),
            ("OTEL_TRACES_SAMPLER_ARG", "2"),
            ("OTEL_EXPORTER_OTLP_HEADERS", "no-equals-sign"),
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "soon"),
            ("OTEL_EXPORTER_OTLP_COMPRESSION", "zstd"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/thrift"),
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://x:4318/elsewhere"),
        ] {
            let mut vars = vec![(k, v)];
            if k == "OTEL_TRACES_SAMPLER_ARG" {
                vars.push(("OTEL_TRACES_SAMPLER", "traceidratio"));
            }
            let e = args().config_from(with(&vars)).unwrap_err();
            assert!(e.contains(k.trim_end_matches("_ARG")), "{k}: {e}");
        }
    }
}
