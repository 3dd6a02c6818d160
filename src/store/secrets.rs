//! BMC passwords at rest: sealed with ChaCha20-Poly1305 (ring, already linked for
//! TLS) under a 256-bit key that never sits in the database. The key comes from
//! systemd's credentials (`LoadCredential=pxed-secret-key:…`, read from
//! `$CREDENTIALS_DIRECTORY/pxed-secret-key`) or, when the unit provides none, from
//! `<data_dir>/secret-key`, generated once (0600). A copy of `pxed.sqlite` alone
//! (a backup, a support bundle) then holds no usable BMC password.
//!
//! Sealed values are `v1:` + hex(nonce ‖ ciphertext ‖ tag); the node id is the
//! associated data, so a sealed value moved to another node's row does not open.
//! Values without the prefix are the plaintext of databases from before this and
//! are sealed on open.

use std::path::{Path, PathBuf};

use ring::aead::{Aad, CHACHA20_POLY1305, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};

/// The credential name the unit gives the key under.
pub const CREDENTIAL: &str = "pxed-secret-key";

const PREFIX: &str = "v1:";

/// Secret-sealing errors.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("secret key {path}: {source}")]
    KeyFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("secret key {path} must hold 32 bytes (64 hex digits), not {len}")]
    KeyLength { path: PathBuf, len: usize },
    #[error(
        "the BMC password of node {node} does not open with this secret key (was the key replaced?)"
    )]
    Open { node: i64 },
}

/// The sealing key.
pub struct SecretKey(LessSafeKey);

impl std::fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretKey(..)")
    }
}

impl SecretKey {
    /// The key from the unit's credentials if it has one, else `<data_dir>/secret-key`
    /// (created with a fresh random key the first time).
    pub fn load(data_dir: &Path) -> Result<SecretKey, SecretError> {
        let from_unit = std::env::var_os("CREDENTIALS_DIRECTORY")
            .map(|d| PathBuf::from(d).join(CREDENTIAL))
            .filter(|p| p.exists());
        let path = from_unit.unwrap_or_else(|| data_dir.join("secret-key"));
        if !path.exists() {
            write_new(&path)?;
        }
        SecretKey::read(&path)
    }

    /// The key in `path` (64 hex digits), e.g. another pxed's, to re-seal its
    /// passwords on import.
    pub fn read(path: &Path) -> Result<SecretKey, SecretError> {
        let path = path.to_owned();
        let text = std::fs::read_to_string(&path).map_err(|source| SecretError::KeyFile {
            path: path.clone(),
            source,
        })?;
        let bytes = hex::decode(text.trim()).unwrap_or_default();
        let key =
            UnboundKey::new(&CHACHA20_POLY1305, &bytes).map_err(|_| SecretError::KeyLength {
                path: path.clone(),
                len: bytes.len(),
            })?;
        Ok(SecretKey(LessSafeKey::new(key)))
    }

    /// Seals `plain` for node `node`.
    pub fn seal(&self, node: i64, plain: &str) -> String {
        let nonce_bytes: [u8; NONCE_LEN] = rand::random();
        let mut buf = plain.as_bytes().to_vec();
        self.0
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce_bytes),
                Aad::from(node.to_be_bytes()),
                &mut buf,
            )
            .expect("ChaCha20-Poly1305 seals any length pxed stores");
        let mut out = nonce_bytes.to_vec();
        out.extend_from_slice(&buf);
        format!("{PREFIX}{}", hex::encode(out))
    }

    /// Opens what [`SecretKey::seal`] made; a value without the prefix is returned
    /// as it is (a plaintext row from before sealing).
    pub fn open(&self, node: i64, stored: &str) -> Result<String, SecretError> {
        let Some(sealed) = stored.strip_prefix(PREFIX) else {
            return Ok(stored.to_string());
        };
        let bad = || SecretError::Open { node };
        let bytes = hex::decode(sealed).map_err(|_| bad())?;
        if bytes.len() < NONCE_LEN {
            return Err(bad());
        }
        let (nonce, rest) = bytes.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| bad())?;
        let mut buf = rest.to_vec();
        let plain = self
            .0
            .open_in_place(nonce, Aad::from(node.to_be_bytes()), &mut buf)
            .map_err(|_| bad())?;
        String::from_utf8(plain.to_vec()).map_err(|_| bad())
    }

    /// Whether `stored` is sealed already.
    pub fn is_sealed(stored: &str) -> bool {
        stored.starts_with(PREFIX)
    }
}

/// Writes a fresh random key, readable by its owner only.
fn write_new(path: &Path) -> Result<(), SecretError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let key: [u8; 32] = rand::random();
    let io = |source| SecretError::KeyFile {
        path: path.to_owned(),
        source,
    };
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(io)?;
    f.write_all(hex::encode(key).as_bytes()).map_err(io)?;
    f.sync_all().map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sealed_values_open_only_for_their_node_and_key() {
        let dir = tempfile::tempdir().unwrap();
        let k = SecretKey::load(dir.path()).unwrap();
        let sealed = k.seal(7, "hunter2");
        assert!(SecretKey::is_sealed(&sealed) && !sealed.contains("hunter2"));
        assert_ne!(sealed, k.seal(7, "hunter2"), "fresh nonce every time");
        assert_eq!(k.open(7, &sealed).unwrap(), "hunter2");
        assert!(matches!(
            k.open(8, &sealed),
            Err(SecretError::Open { node: 8 })
        ));
        assert_eq!(k.open(7, "plain-from-before").unwrap(), "plain-from-before");
        // The same file gives the same key; another data dir, another key.
        assert_eq!(
            SecretKey::load(dir.path())
                .unwrap()
                .open(7, &sealed)
                .unwrap(),
            "hunter2"
        );
        let other = tempfile::tempdir().unwrap();
        assert!(
            SecretKey::load(other.path())
                .unwrap()
                .open(7, &sealed)
                .is_err()
        );
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join("secret-key"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        std::fs::write(other.path().join("secret-key"), "abcd").unwrap();
        let e = SecretKey::load(other.path()).unwrap_err().to_string();
        assert!(e.contains("must hold 32 bytes"), "{e}");
    }
}
