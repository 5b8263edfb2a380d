//! Certificates made by a test: a throwaway CA and leaf certificates for
//! the addresses a test's servers listen on.

use std::path::{Path, PathBuf};

/// A CA whose certificate is written to `dir/ca.pem`.
pub struct TestCa {
    dir: PathBuf,
    key: rcgen::KeyPair,
    cert: rcgen::Certificate,
}

/// A leaf certificate and its key, as PEM files.
pub struct Issued {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TestCa {
    pub fn new(dir: &Path) -> TestCa {
        std::fs::create_dir_all(dir).unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "Shoal test CA");
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        std::fs::write(dir.join("ca.pem"), cert.pem()).unwrap();
        TestCa {
            dir: dir.to_owned(),
            key,
            cert,
        }
    }

    /// The CA's certificate (PEM).
    pub fn pem(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// A certificate for `names` (DNS names or IP addresses), signed by
    /// this CA, written as `name.pem` and `name.key`.
    pub fn issue(&self, name: &str, names: &[&str]) -> Issued {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let params = rcgen::CertificateParams::new(names).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.cert, &self.key).unwrap();
        let issued = Issued {
            cert: self.dir.join(format!("{name}.pem")),
            key: self.dir.join(format!("{name}.key")),
        };
        std::fs::write(&issued.cert, cert.pem()).unwrap();
        std::fs::write(&issued.key, key.serialize_pem()).unwrap();
        issued
    }
}
