//! A small HTTP/1.1 client for the rules service (plain `http://host:port`, one request per
//! connection): what the agent's follower and the `floodgate rules` CLI need, nothing more.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A response: status, headers (lower-case names) and body.
#[derive(Debug)]
pub struct Response {
    /// The status code.
    pub status: u16,
    /// The headers, names lower-cased.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: Vec<u8>,
}

impl Response {
    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Sends one request to `base` (`http://host:port`) and reads the whole response, within `timeout`.
pub async fn request(
    base: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    extra: &[(&str, String)],
    body: Option<&[u8]>,
    timeout: Duration,
) -> Result<Response, String> {
    let host = base
        .strip_prefix("http://")
        .ok_or_else(|| format!("{base:?}: only http://host:port is supported"))?
        .trim_end_matches('/');
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(host)
            .await
            .map_err(|e| format!("connect {host}: {e}"))?;
        let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n");
        if let Some(t) = token {
            head.push_str(&format!("Authorization: Bearer {t}\r\n"));
        }
        for (k, v) in extra {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        let body = body.unwrap_or_default();
        if !body.is_empty() || method == "PUT" || method == "POST" {
            head.push_str(&format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                body.len()
            ));
        }
        head.push_str("\r\n");
        s.write_all(head.as_bytes()).await.map_err(|e| e.to_string())?;
        s.write_all(body).await.map_err(|e| e.to_string())?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).await.map_err(|e| e.to_string())?;
        parse(&raw)
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| format!("{method} {base}{path}: no answer within {timeout:?}"))?
}

fn parse(raw: &[u8]) -> Result<Response, String> {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("response without a header end")?;
    let head = std::str::from_utf8(&raw[..split]).map_err(|_| "response head is not UTF-8")?;
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .ok_or("response without a status")?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    if let Some(n) = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .and_then(|(_, v)| v.parse().ok())
    {
        body.truncate(n);
    }
    Ok(Response {
        status,
        headers,
        body,
    })
}
