//! The rules API as the CLI calls it: the server and token of every request, and the pieces of a
//! request's path and headers.

use std::time::Duration;

use floodgate_rules_service::http;

/// Where every request of one command goes, and as whom.
pub struct Api<'a> {
    /// `--server`: `http://host:port` or `https://host:port`.
    pub server: &'a str,
    /// `--token`, or `--token-file`'s contents.
    pub token: Option<&'a str>,
}

impl Api<'_> {
    /// One request, answered within 10 s; any status is an answer, only a failed call an error.
    pub async fn call(
        &self,
        method: &'static str,
        path: &str,
        extra: &[(&'static str, String)],
        body: Option<&[u8]>,
    ) -> anyhow::Result<http::Response> {
        http::request(
            self.server,
            method,
            path,
            self.token,
            extra,
            body,
            Duration::from_secs(10),
        )
        .await
        .map_err(|e| anyhow::anyhow!(e))
    }
}

/// The `If-Match` header of `--if-match`, if given.
pub fn if_match(v: Option<u64>) -> Vec<(&'static str, String)> {
    v.map(|v| vec![("If-Match", format!("\"{v}\""))])
        .unwrap_or_default()
}

/// What a path segment or query value keeps as it is: RFC 3986's unreserved characters, and `:`
/// (a client key's separator, legal in a segment).
const KEPT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~')
    .remove(b':');

/// A path segment or query value with everything but unreserved characters percent-encoded.
pub fn encode(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, KEPT).to_string()
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_key_is_one_path_segment() {
        assert_eq!(super::encode("apikey:a/b c%é~"), "apikey:a%2Fb%20c%25%C3%A9~");
    }
}
