//! The cluster's certificates, made with `openssl`: one CA signs every serving and client
//! certificate (ECDSA P-256: quick to make on a small machine), and a key pair signs the
//! service-account tokens.

use std::{path::Path, process::Command};

use anyhow::{Context as _, bail};

use crate::util::describe;

/// The service IP of `kubernetes.default` (first address of the service range).
pub const API_SERVICE_IP: &str = "10.96.0.1";

/// A client or serving certificate to make.
struct Leaf<'a> {
    /// File stem under `pki/`: `NAME.crt`, `NAME.key`.
    name: &'a str,
    /// The subject: `/O=…/CN=…`. Kubernetes reads the user from CN and groups from O.
    subject: String,
    /// `subjectAltName`, for serving certificates.
    sans: Option<String>,
}

/// Makes everything under `pki` unless the CA is already there (a second `up` keeps them).
pub fn ensure(pki: &Path, node: &str) -> anyhow::Result<()> {
    if pki.join("ca.crt").is_file() && pki.join("sa.pub").is_file() {
        return Ok(());
    }
    std::fs::create_dir_all(pki).with_context(|| format!("creating {}", pki.display()))?;
    openssl(
        "the CA",
        pki,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "3650",
            "-subj",
            "/CN=gpud-test-cluster-ca",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        ],
    )?;
    let apiserver_sans = format!(
        "IP:127.0.0.1,IP:{API_SERVICE_IP},DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,\
         DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,DNS:{node}"
    );
    let leaves = [
        Leaf {
            name: "apiserver",
            subject: "/CN=kube-apiserver".into(),
            sans: Some(match super::host_ip() {
                Some(ip) => format!("{apiserver_sans},IP:{ip}"),
                None => apiserver_sans,
            }),
        },
        Leaf {
            name: "admin",
            subject: "/O=system:masters/CN=gpud-test-admin".into(),
            sans: None,
        },
        // What the API server presents to kubelets (exec, logs): the kubelet authorizes it by
        // webhook, and system:masters may do all.
        Leaf {
            name: "apiserver-kubelet-client",
            subject: "/O=system:masters/CN=kube-apiserver-kubelet-client".into(),
            sans: None,
        },
        Leaf {
            name: "kubelet",
            subject: format!("/O=system:nodes/CN=system:node:{node}"),
            sans: None,
        },
        Leaf {
            name: "controller-manager",
            subject: "/CN=system:kube-controller-manager".into(),
            sans: None,
        },
        Leaf {
            name: "scheduler",
            subject: "/CN=system:kube-scheduler".into(),
            sans: None,
        },
        // The default `system:node-proxier` binding names this user.
        Leaf {
            name: "kube-proxy",
            subject: "/CN=system:kube-proxy".into(),
            sans: None,
        },
    ];
    for leaf in &leaves {
        sign(pki, leaf)?;
    }
    openssl(
        "the service-account key",
        pki,
        &[
            "genpkey",
            "-algorithm",
            "EC",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-out",
            "sa.key",
        ],
    )?;
    openssl(
        "the service-account public key",
        pki,
        &["pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub"],
    )
}

/// A key and a CSR for `leaf`, signed by the CA.
fn sign(pki: &Path, leaf: &Leaf) -> anyhow::Result<()> {
    let (key, csr, crt) = (
        format!("{}.key", leaf.name),
        format!("{}.csr", leaf.name),
        format!("{}.crt", leaf.name),
    );
    let what = format!("the {} certificate", leaf.name);
    openssl(
        &what,
        pki,
        &[
            "req",
            "-new",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            &leaf.subject,
        ],
    )?;
    let ext = format!("{}.ext", leaf.name);
    let mut text = String::from(
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n",
    );
    match &leaf.sans {
        Some(sans) => text.push_str(&format!(
            "extendedKeyUsage=serverAuth,clientAuth\nsubjectAltName={sans}\n"
        )),
        None => text.push_str("extendedKeyUsage=clientAuth\n"),
    }
    std::fs::write(pki.join(&ext), text).with_context(|| format!("writing {ext}"))?;
    openssl(
        &what,
        pki,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &crt,
            "-days",
            "365",
            "-extfile",
            &ext,
        ],
    )?;
    for f in [csr, ext] {
        let _ = std::fs::remove_file(pki.join(f));
    }
    Ok(())
}

/// `openssl ARGS` in `dir` (relative file names are `dir`'s).
fn openssl(what: &str, dir: &Path, args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .context("cluster: certificates: cannot start openssl (Debian `openssl`)")?;
    if !out.status.success() {
        bail!(
            "cluster: certificates: {what}: openssl failed ({}): {}",
            describe(out.status),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}
