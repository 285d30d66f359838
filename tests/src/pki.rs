//! A private CA for the TLS tests: a temporary directory holding its certificate (`ca.pem`) and the
//! certificates it signs (`<who>.pem`, `<who>.key`), made with rcgen.

use std::path::Path;

/// A CA of a test's own, and the files it wrote.
pub struct TestCa {
    dir: tempfile::TempDir,
    params: rcgen::CertificateParams,
    key: rcgen::KeyPair,
}

impl TestCa {
    /// A new CA named `name` (its common name), its certificate written to `ca.pem`.
    pub fn new(name: &str) -> TestCa {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        let key = rcgen::KeyPair::generate().expect("a key");
        let cert = params.self_signed(&key).expect("a self-signed CA");
        std::fs::write(dir.path().join("ca.pem"), cert.pem()).expect("write ca.pem");
        TestCa { dir, params, key }
    }

    /// A certificate for `names` (host names or IP addresses) signed by this CA, written to
    /// `<who>.pem` and its key to `<who>.key`; both PEM texts returned.
    pub fn issue(&self, who: &str, names: &[&str]) -> (String, String) {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let key = rcgen::KeyPair::generate().expect("a key");
        let issuer = rcgen::Issuer::from_params(&self.params, &self.key);
        let cert = rcgen::CertificateParams::new(names)
            .expect("certificate params")
            .signed_by(&key, &issuer)
            .expect("a signed certificate");
        let (cert, key) = (cert.pem(), key.serialize_pem());
        std::fs::write(self.dir.path().join(format!("{who}.pem")), &cert).expect("write the certificate");
        std::fs::write(self.dir.path().join(format!("{who}.key")), &key).expect("write the key");
        (cert, key)
    }

    /// The path of `name` in the CA's directory, as a string (for a flag).
    pub fn path(&self, name: &str) -> String {
        self.dir().join(name).to_str().expect("a UTF-8 path").to_string()
    }

    /// The CA's directory (other files of the test may go there too).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}
