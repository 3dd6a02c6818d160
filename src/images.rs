//! The image catalog (`images/*.toml`) and importing kernels and initrds from a mirror.
//!
//! Every path in the catalog is relative to the mirror base URL set in config
//! (`mirror_base`), so the same catalog serves a public mirror, a lab mirror or a
//! directory on disk. Import downloads each architecture's kernel and initrd into
//! `images_dir/<name>/<arch>/{kernel,initrd}`, hashing while it streams, and only
//! renames a file into place once its size and SHA-256 are known (and match the
//! catalog when it gives one).

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::io::AsyncWriteExt;

pub use crate::model::Arch;

/// How an image is installed unattended, i.e. which generated config it reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// Anaconda (RHEL, Rocky, Alma, Fedora): `inst.ks=`.
    Kickstart,
    /// Ubuntu Subiquity: autoinstall from cloud-init NoCloud (`ds=nocloud;s=`).
    Autoinstall,
    /// debian-installer: `auto=true url=`.
    Preseed,
    /// A whole-disk image written by pxed's deploy agent from its deploy ramdisk
    /// (`kernel`/`initrd` are the ramdisk; `disk` is the image).
    Disk,
}

impl Family {
    /// The catalog name.
    pub fn as_str(self) -> &'static str {
        match self {
            Family::Kickstart => "kickstart",
            Family::Autoinstall => "autoinstall",
            Family::Preseed => "preseed",
            Family::Disk => "disk",
        }
    }
}

/// One architecture's install media; every path is relative to the mirror base.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArchDef {
    /// The installer kernel.
    pub kernel: String,
    /// The installer initrd.
    pub initrd: String,
    /// Image-specific kernel arguments; pxed adds the config URL and the console.
    #[serde(default)]
    pub cmdline: String,
    /// The install source: the BaseOS tree (kickstart), the live-server ISO
    /// (autoinstall, casper's `url=`), the archive root (preseed). Unused by `disk`.
    #[serde(default)]
    pub repo: String,
    /// `disk` family: the zstd-compressed whole-disk image.
    #[serde(default)]
    pub disk: Option<String>,
    /// `disk` family: the image's manifest (JSON with `raw_size`, `raw_sha256`,
    /// `file_sha256`, `root_partition`), as `images/build/debian-12.sh` writes it.
    #[serde(default)]
    pub disk_manifest: Option<String>,
    /// Further repositories by name (Rocky's AppStream, Ubuntu's package archive).
    #[serde(default)]
    pub extra_repos: BTreeMap<String, String>,
    /// Expected SHA-256 of the kernel, hex; import refuses a file that differs.
    #[serde(default)]
    pub sha256_kernel: Option<String>,
    /// Expected SHA-256 of the initrd, hex.
    #[serde(default)]
    pub sha256_initrd: Option<String>,
}

/// One catalog entry: an OS release installable on one or more architectures.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageDef {
    /// Unique name, also the directory under `images_dir` (`[a-z0-9][a-z0-9._-]*`).
    pub name: String,
    /// Free text for the status page.
    #[serde(default)]
    pub description: String,
    /// Which unattended-install mechanism the image uses.
    pub family: Family,
    /// Install media per architecture.
    pub arches: BTreeMap<Arch, ArchDef>,
    /// OpenSSH public keys for root on systems installed from this image, added to
    /// the config's `ssh_authorized_keys`.
    #[serde(default)]
    pub ssh_authorized_keys: Vec<String>,
}

impl ImageDef {
    /// The media for `arch`, or an error naming the image.
    pub fn arch(&self, arch: Arch) -> Result<&ArchDef, ImageError> {
        self.arches.get(&arch).ok_or_else(|| ImageError::NoArch {
            image: self.name.clone(),
            arch,
        })
    }
}

/// One downloaded file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImportedFile {
    /// Where it came from.
    pub source: String,
    /// Where it is now (`images_dir/<name>/<arch>/kernel`).
    pub path: PathBuf,
    /// Lower-case hex SHA-256 of the content.
    pub sha256: String,
    /// Size in bytes.
    pub size: u64,
}

/// One architecture's imported kernel and initrd.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImportedArch {
    /// The installer kernel.
    pub kernel: ImportedFile,
    /// The installer initrd.
    pub initrd: ImportedFile,
    /// `disk` family: the disk image.
    #[serde(default)]
    pub disk: Option<ImportedDisk>,
}

/// A disk image's manifest, as the image build script writes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskManifest {
    /// Size in bytes of the raw disk image.
    pub raw_size: u64,
    /// SHA-256 (hex) of the raw disk image.
    pub raw_sha256: String,
    /// SHA-256 (hex) of the compressed file.
    #[serde(default)]
    pub file_sha256: Option<String>,
    /// Partition number of the root filesystem (grown to the disk).
    pub root_partition: u32,
}

/// An imported disk image: the compressed file pxed serves and what the deploy agent
/// must find once it is written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImportedDisk {
    /// The compressed file (`images_dir/<name>/<arch>/disk.raw.zst`).
    pub file: ImportedFile,
    /// Size in bytes of the raw disk image.
    pub raw_size: u64,
    /// SHA-256 (hex) of the raw disk image.
    pub raw_sha256: String,
    /// Partition number of the root filesystem.
    pub root_partition: u32,
}

/// What an image row's `definition` column holds: the catalog entry and what import
/// fetched.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredImage {
    pub def: ImageDef,
    pub imported: ImportedImage,
    /// The `mirror_base` the import checked (`pxed image check`) and found complete;
    /// `None` for `--no-check` imports. A reinstall re-checks it, cheaply
    /// ([`MirrorGate`]), while the config still names it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mirror_checked: Option<String>,
}

/// How long a passing mirror check stands before a reinstall checks again.
pub const MIRROR_CHECK_TTL: std::time::Duration = std::time::Duration::from_secs(60);

/// The cheap mirror check before a reinstall: an image imported from a checked
/// mirror is checked again (HEAD requests, [`check_mirror`]) before a node is
/// released and power-cycled into an installer that would fail on a missing file. A
/// pass is remembered for [`MIRROR_CHECK_TTL`] per image and architecture, so a rack
/// reclaimed at once costs one check; a failure is never remembered, so a fixed
/// mirror is seen at the next call.
#[derive(Debug, Default)]
pub struct MirrorGate {
    passed: std::sync::Mutex<std::collections::HashMap<(String, Option<Arch>), std::time::Instant>>,
    /// Checks that went to the mirror (not answered from the remembered pass).
    pub checks: crate::metrics::Counter,
    /// Reinstalls refused because the mirror lacked something or did not answer.
    pub refused: crate::metrics::Counter,
}

impl MirrorGate {
    /// `Ok` when `img` may be installed on an `arch` node (all its arches for
    /// `None`) from `mirror_base`; `Err` says what is missing, in the words of
    /// `pxed image check`. Disk images and unchecked imports pass without a check.
    pub async fn check(
        &self,
        img: &StoredImage,
        arch: Option<Arch>,
        mirror_base: Option<&str>,
    ) -> Result<(), String> {
        let (Some(checked), Some(mirror)) = (&img.mirror_checked, mirror_base) else {
            return Ok(());
        };
        if img.def.family == Family::Disk || checked != mirror {
            return Ok(());
        }
        let arch = arch.filter(|a| img.def.arches.contains_key(a));
        let key = (img.def.name.clone(), arch);
        let fresh = |m: &std::collections::HashMap<_, std::time::Instant>| {
            m.get(&key).is_some_and(|t| t.elapsed() < MIRROR_CHECK_TTL)
        };
        if fresh(&self.passed.lock().unwrap_or_else(|e| e.into_inner())) {
            return Ok(());
        }
        self.checks.inc();
        let outcome = match check_mirror(&img.def, arch, mirror).await {
            Ok(checked) => {
                let missing: Vec<String> = checked
                    .iter()
                    .filter(|c| !c.present)
                    .map(|c| format!("{} {c}", c.arch))
                    .collect();
                if missing.is_empty() {
                    Ok(())
                } else {
                    Err(format!(
                        "the mirror lacks what image {}'s installer needs: {}",
                        img.def.name,
                        missing.join("; ")
                    ))
                }
            }
            Err(e) => Err(format!(
                "checking the mirror for image {}: {e}",
                img.def.name
            )),
        };
        let mut passed = self.passed.lock().unwrap_or_else(|e| e.into_inner());
        match &outcome {
            Ok(()) => {
                if passed.len() >= 1024 {
                    passed.clear();
                }
                passed.insert(key, std::time::Instant::now());
            }
            Err(_) => {
                passed.remove(&key);
                self.refused.inc();
            }
        }
        outcome
    }
}

impl StoredImage {
    /// Decodes a stored row; a row that does not decode is an error naming the image,
    /// never "not imported".
    pub fn decode(name: &str, json: &str) -> Result<StoredImage, ImageError> {
        serde_json::from_str(json).map_err(|e| ImageError::Stored {
            image: name.to_string(),
            reason: e.to_string(),
        })
    }
}

/// The result of [`import`], stored by the caller as JSON.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImportedImage {
    /// The catalog name.
    pub name: String,
    /// The install family.
    pub family: Family,
    /// Files per architecture.
    pub arches: BTreeMap<Arch, ImportedArch>,
}

/// Errors from loading the catalog, importing media or building a command line.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Parse {
        path: PathBuf,
        #[source]
        source: Box<toml::de::Error>,
    },
    #[error("image {image}: {field}: {reason}")]
    Invalid {
        image: String,
        field: String,
        reason: &'static str,
    },
    #[error("image {name} is defined twice ({first} and {second})")]
    Duplicate {
        name: String,
        first: PathBuf,
        second: PathBuf,
    },
    #[error("image {image} has no media for {arch}")]
    NoArch { image: String, arch: Arch },
    #[error("fetching {url}: {source}")]
    Fetch {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("fetching {url}: HTTP {status}")]
    Status { url: String, status: u16 },
    #[error("{url}: SHA-256 is {actual}, the catalog says {expected}")]
    ChecksumMismatch {
        url: String,
        expected: String,
        actual: String,
    },
    #[error("unsupported source URL {url}")]
    BadUrl { url: String },
    #[error("kernel argument {arg:?} would be misread by iPXE")]
    UnsafeCmdline { arg: String },
    #[error("stored image {image} does not decode: {reason}")]
    Stored { image: String, reason: String },
    #[error("disk manifest {path}: {reason}")]
    Manifest { path: PathBuf, reason: String },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ImageError + '_ {
    move |source| ImageError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn invalid(image: &str, field: impl Into<String>, reason: &'static str) -> ImageError {
    ImageError::Invalid {
        image: image.to_string(),
        field: field.into(),
        reason,
    }
}

fn valid_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    matches!(bytes.next(), Some(b) if b.is_ascii_lowercase() || b.is_ascii_digit())
        && bytes.all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-')
        })
        && name.len() <= 64
}

/// A catalog path must stay under the mirror base: relative, no `..`, no URL scheme,
/// nothing that a URL or a kernel command line would read differently.
fn check_rel_path(image: &str, field: &str, path: &str) -> Result<(), ImageError> {
    if path.is_empty() {
        return Err(invalid(image, field, "is empty"));
    }
    if path.starts_with('/') || path.contains("://") || path.contains('\\') {
        return Err(invalid(image, field, "must be relative to the mirror base"));
    }
    if path.split('/').any(|seg| seg == ".." || seg == ".") {
        return Err(invalid(image, field, "must not contain . or .. segments"));
    }
    if path
        .chars()
        .any(|c| c.is_whitespace() || c.is_control() || matches!(c, '?' | '#' | '"' | '\''))
    {
        return Err(invalid(
            image,
            field,
            "must not contain spaces, quotes, ? or #",
        ));
    }
    Ok(())
}

fn check_sha(image: &str, field: &str, sha: &Option<String>) -> Result<(), ImageError> {
    match sha {
        Some(s) if s.len() != 64 || !s.bytes().all(|b| b.is_ascii_hexdigit()) => {
            Err(invalid(image, field, "must be 64 hex digits"))
        }
        _ => Ok(()),
    }
}

/// Checks everything the TOML types do not: the name, paths and checksums.
pub fn validate(def: &ImageDef) -> Result<(), ImageError> {
    let n = def.name.as_str();
    if !valid_name(n) {
        return Err(invalid(n, "name", "must match [a-z0-9][a-z0-9._-]{0,63}"));
    }
    if def.arches.is_empty() {
        return Err(invalid(n, "arches", "needs at least one architecture"));
    }
    for (arch, a) in &def.arches {
        let f = |k: &str| format!("arches.{arch}.{k}");
        check_rel_path(n, &f("kernel"), &a.kernel)?;
        check_rel_path(n, &f("initrd"), &a.initrd)?;
        if def.family == Family::Disk {
            let (Some(disk), Some(manifest)) = (&a.disk, &a.disk_manifest) else {
                return Err(invalid(
                    n,
                    f("disk"),
                    "a disk image needs disk and disk_manifest",
                ));
            };
            check_rel_path(n, &f("disk"), disk)?;
            check_rel_path(n, &f("disk_manifest"), manifest)?;
        } else {
            check_rel_path(n, &f("repo"), &a.repo)?;
        }
        for (rname, rpath) in &a.extra_repos {
            if !valid_name(rname) {
                return Err(invalid(n, f("extra_repos"), "names must be [a-z0-9._-]"));
            }
            check_rel_path(n, &f(&format!("extra_repos.{rname}")), rpath)?;
        }
        check_sha(n, &f("sha256_kernel"), &a.sha256_kernel)?;
        check_sha(n, &f("sha256_initrd"), &a.sha256_initrd)?;
        check_cmdline(&a.cmdline)?;
    }
    Ok(())
}

/// Parses one catalog file's text.
pub fn parse_image(text: &str, path: &Path) -> Result<ImageDef, ImageError> {
    let def: ImageDef = toml::from_str(text).map_err(|e| ImageError::Parse {
        path: path.to_path_buf(),
        source: Box::new(e),
    })?;
    validate(&def)?;
    Ok(def)
}

/// Loads every `*.toml` in `dir` (one image per file), sorted by file name. Unknown
/// keys, absolute or `..` paths, malformed checksums and duplicate names are errors.
pub fn load_catalog(dir: &Path) -> Result<Vec<ImageDef>, ImageError> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io_err(dir))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "toml") && p.is_file())
        .collect();
    files.sort();
    let mut seen: BTreeMap<String, PathBuf> = BTreeMap::new();
    let mut out = Vec::with_capacity(files.len());
    for path in files {
        let text = std::fs::read_to_string(&path).map_err(io_err(&path))?;
        let def = parse_image(&text, &path)?;
        if let Some(first) = seen.insert(def.name.clone(), path.clone()) {
            return Err(ImageError::Duplicate {
                name: def.name,
                first,
                second: path,
            });
        }
        out.push(def);
    }
    Ok(out)
}

/// Joins the mirror base and a catalog path with exactly one `/`.
pub fn mirror_url(mirror_base: &str, rel: &str) -> String {
    format!(
        "{}/{}",
        mirror_base.trim_end_matches('/'),
        rel.trim_start_matches('/')
    )
}

/// iPXE splits a command on whitespace and treats the tokens `||`, `&&`, `;` and any
/// token starting with `#` specially, and expands `${...}`: an argument like that would
/// change the script rather than reach the kernel. `ds=nocloud;s=...` is one token, so
/// its `;` is safe in iPXE (GRUB, by contrast, would need it escaped).
fn check_cmdline(cmdline: &str) -> Result<(), ImageError> {
    for arg in cmdline.split_whitespace() {
        if matches!(arg, "||" | "&&" | ";") || arg.starts_with('#') || arg.contains("${") {
            return Err(ImageError::UnsafeCmdline {
                arg: arg.to_string(),
            });
        }
    }
    if cmdline.contains(['\n', '\r', '"', '\'']) {
        return Err(ImageError::UnsafeCmdline {
            arg: cmdline.to_string(),
        });
    }
    Ok(())
}

/// The installer kernel command line for one node: the image's own arguments, the
/// install source and generated-config URL for its family, then the consoles (the
/// serial one last, so the installer's UI lands on it). `config_base` is
/// `http://<server>/cfg/<token>`; the config files hang below it. `syslog` is pxed's
/// syslog receiver as `host:port`: debian-installer (`log_host=`/`log_port=`, with
/// cdebconf's protocol log so the dialog an install stops at is named) and Anaconda
/// (`inst.syslog=`) send their logs there; subiquity reports through the autoinstall
/// `reporting` webhook instead (see the user-data).
pub fn kernel_cmdline(
    image: &ImageDef,
    arch: Arch,
    mirror_base: &str,
    config_base: &str,
    hostname: &str,
    syslog: Option<&str>,
) -> Result<String, ImageError> {
    let a = image.arch(arch)?;
    let cfg = config_base.trim_end_matches('/');
    let repo = mirror_url(mirror_base, &a.repo);
    let mut args: Vec<String> = a.cmdline.split_whitespace().map(String::from).collect();
    match image.family {
        Family::Kickstart => {
            args.push(format!("inst.repo={repo}"));
            args.push(format!("inst.ks={cfg}/kickstart"));
            if let Some(s) = syslog {
                args.push(format!("inst.syslog={s}"));
            }
        }
        Family::Autoinstall => {
            args.push(format!("url={repo}"));
            args.push("autoinstall".into());
            // cloud-init appends `user-data` / `meta-data` to the seed, so keep the slash.
            args.push(format!("ds=nocloud;s={cfg}/"));
        }
        Family::Disk => {
            // The deploy agent reads these; it asks `<url>/cb/<token>/deploy` for its plan.
            let Some((server, token)) = cfg.rsplit_once("/cfg/") else {
                return Err(ImageError::UnsafeCmdline {
                    arg: config_base.to_string(),
                });
            };
            args.push(format!("pxed.url={server}"));
            args.push(format!("pxed.token={token}"));
        }
        Family::Preseed => {
            args.extend(["auto=true".into(), "priority=critical".into()]);
            args.push(format!("url={cfg}/preseed"));
            // netcfg runs before the preseed file is fetched: the hostname must be here.
            args.push(format!("hostname={hostname}"));
            args.push("domain=".into());
            // With no name server from DHCP (an isolated VLAN), netcfg asks for one at
            // critical priority before it fetches the preseed: answer "none" here. A
            // DHCP server that hands out name servers skips the question anyway.
            args.push("netcfg/get_nameservers=".into());
            if let Some((host, port)) = syslog.and_then(|s| s.rsplit_once(':')) {
                args.push(format!("log_host={host}"));
                args.push(format!("log_port={port}"));
                // cdebconf logs its protocol: `INPUT critical <template>` names the
                // dialog an unattended install would otherwise wait at silently.
                args.push("DEBCONF_DEBUG=developer".into());
            }
        }
    }
    args.push("console=tty0".into());
    args.push(arch.serial_console().into());
    let line = args.join(" ");
    check_cmdline(&line)?;
    Ok(line)
}

/// Where a catalog file is fetched from.
enum Source {
    Http(String),
    File(PathBuf),
}

fn source_for(url: &str) -> Result<Source, ImageError> {
    if url.starts_with("http://") || url.starts_with("https://") {
        Ok(Source::Http(url.to_string()))
    } else if let Some(p) = url.strip_prefix("file://") {
        Ok(Source::File(PathBuf::from(p)))
    } else if !url.contains("://") {
        Ok(Source::File(PathBuf::from(url)))
    } else {
        Err(ImageError::BadUrl {
            url: url.to_string(),
        })
    }
}

fn http_client() -> Result<reqwest::Client, ImageError> {
    // reqwest is built without a default TLS provider; ignore "already installed".
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        // Per read, not total: an initrd over a slow lab link may take minutes.
        .read_timeout(Duration::from_secs(60))
        .build()
        .map_err(|source| ImageError::Fetch {
            url: String::new(),
            source,
        })
}

/// Removes the partial file unless disarmed, so no error path leaves one behind.
struct PartialFile(Option<PathBuf>);

impl Drop for PartialFile {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Downloads `url` to `dest`: streams into `dest.partial` while hashing, checks the
/// SHA-256 if one is expected, fsyncs, then renames into place.
async fn fetch_file(
    client: &reqwest::Client,
    url: &str,
    dest: &Path,
    expected: Option<&str>,
) -> Result<ImportedFile, ImageError> {
    let partial = dest.with_extension("partial");
    let mut guard = PartialFile(Some(partial.clone()));
    let mut out = tokio::fs::File::create(&partial)
        .await
        .map_err(io_err(&partial))?;
    let mut hasher = Sha256::new();
    let mut size: u64 = 0;
    match source_for(url)? {
        Source::Http(u) => {
            let fetch = |source| ImageError::Fetch {
                url: u.clone(),
                source,
            };
            let mut resp = client.get(&u).send().await.map_err(fetch)?;
            if !resp.status().is_success() {
                return Err(ImageError::Status {
                    url: u.clone(),
                    status: resp.status().as_u16(),
                });
            }
            while let Some(chunk) = resp.chunk().await.map_err(fetch)? {
                hasher.update(&chunk);
                size += chunk.len() as u64;
                out.write_all(&chunk).await.map_err(io_err(&partial))?;
            }
        }
        Source::File(p) => {
            use tokio::io::AsyncReadExt;
            let mut src = tokio::fs::File::open(&p).await.map_err(io_err(&p))?;
            let mut buf = vec![0u8; 256 * 1024];
            loop {
                let n = src.read(&mut buf).await.map_err(io_err(&p))?;
                if n == 0 {
                    break;
                }
                hasher.update(&buf[..n]);
                size += n as u64;
                out.write_all(&buf[..n]).await.map_err(io_err(&partial))?;
            }
        }
    }
    let sha256 = hex::encode(hasher.finalize());
    if let Some(want) = expected
        && !want.eq_ignore_ascii_case(&sha256)
    {
        return Err(ImageError::ChecksumMismatch {
            url: url.to_string(),
            expected: want.to_ascii_lowercase(),
            actual: sha256,
        });
    }
    out.sync_all().await.map_err(io_err(&partial))?;
    drop(out);
    tokio::fs::rename(&partial, dest)
        .await
        .map_err(io_err(dest))?;
    guard.0 = None;
    Ok(ImportedFile {
        source: url.to_string(),
        path: dest.to_path_buf(),
        sha256,
        size,
    })
}

/// Fetches a disk image's manifest, then the image, checked against the manifest's
/// file checksum.
async fn import_disk(
    client: &reqwest::Client,
    mirror_base: &str,
    dir: &Path,
    disk: &str,
    manifest: &str,
) -> Result<ImportedDisk, ImageError> {
    let mpath = dir.join("disk.json");
    fetch_file(client, &mirror_url(mirror_base, manifest), &mpath, None).await?;
    let text = tokio::fs::read_to_string(&mpath)
        .await
        .map_err(io_err(&mpath))?;
    let bad = |reason: String| ImageError::Manifest {
        path: mpath.clone(),
        reason,
    };
    let m: DiskManifest = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    if m.raw_sha256.len() != 64 || !m.raw_sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(bad("raw_sha256 must be 64 hex digits".into()));
    }
    if m.raw_size == 0 || m.root_partition == 0 {
        return Err(bad("raw_size and root_partition must be more than 0".into()));
    }
    let file = fetch_file(
        client,
        &mirror_url(mirror_base, disk),
        &dir.join("disk.raw.zst"),
        m.file_sha256.as_deref(),
    )
    .await?;
    Ok(ImportedDisk {
        file,
        raw_size: m.raw_size,
        raw_sha256: m.raw_sha256.to_ascii_lowercase(),
        root_partition: m.root_partition,
    })
}

/// Downloads every architecture's kernel and initrd of `def` from `mirror_base`
/// (`http(s)://`, `file://` or a plain directory path) into
/// `images_dir/<name>/<arch>/{kernel,initrd}`. A file whose SHA-256 differs from the
/// catalog's is deleted and the import fails; files already in place are replaced only
/// by a complete, verified download.
pub async fn import(
    def: &ImageDef,
    mirror_base: &str,
    images_dir: &Path,
) -> Result<ImportedImage, ImageError> {
    validate(def)?;
    let client = http_client()?;
    let mut arches = BTreeMap::new();
    for (arch, a) in &def.arches {
        let dir = images_dir.join(&def.name).join(arch.as_str());
        tokio::fs::create_dir_all(&dir)
            .await
            .map_err(io_err(&dir))?;
        let kernel = fetch_file(
            &client,
            &mirror_url(mirror_base, &a.kernel),
            &dir.join("kernel"),
            a.sha256_kernel.as_deref(),
        )
        .await?;
        let initrd = fetch_file(
            &client,
            &mirror_url(mirror_base, &a.initrd),
            &dir.join("initrd"),
            a.sha256_initrd.as_deref(),
        )
        .await?;
        let disk = match (def.family, &a.disk, &a.disk_manifest) {
            (Family::Disk, Some(disk), Some(manifest)) => {
                Some(import_disk(&client, mirror_base, &dir, disk, manifest).await?)
            }
            _ => None,
        };
        arches.insert(
            *arch,
            ImportedArch {
                kernel,
                initrd,
                disk,
            },
        );
    }
    Ok(ImportedImage {
        name: def.name.clone(),
        family: def.family,
        arches,
    })
}

/// One thing an installer will fetch from the mirror: present when every path of any
/// one of `any_of` is (Debian's `InRelease`, or `Release` with `Release.gpg`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Required {
    /// Alternatives, each a set of paths relative to the mirror base.
    pub any_of: Vec<Vec<String>>,
}

impl Required {
    fn one(path: String) -> Required {
        Required {
            any_of: vec![vec![path]],
        }
    }

    fn either(paths: impl IntoIterator<Item = String>) -> Required {
        Required {
            any_of: paths.into_iter().map(|p| vec![p]).collect(),
        }
    }
}

/// The Debian suite a catalog path names (`.../dists/<suite>/...`).
fn debian_suite(path: &str) -> Option<&str> {
    let mut segs = path.split('/');
    segs.find(|s| *s == "dists")?;
    segs.next().filter(|s| !s.is_empty())
}

/// What the installer of `def` will ask the mirror for on `arch`, in the order it asks:
/// pure, so the list per family is unit-tested and the checker only looks paths up.
pub fn required_paths(def: &ImageDef, arch: Arch) -> Result<Vec<Required>, ImageError> {
    let a = def.arch(arch)?;
    let mut out = vec![
        Required::one(a.kernel.clone()),
        Required::one(a.initrd.clone()),
    ];
    let repo = |rel: &str| format!("{}/{rel}", a.repo.trim_end_matches('/'));
    match def.family {
        Family::Preseed => {
            let suite = debian_suite(&a.kernel).ok_or_else(|| {
                invalid(
                    &def.name,
                    format!("arches.{arch}.kernel"),
                    "names no dists/<suite>/ to check the archive against",
                )
            })?;
            let d = |rel: &str| repo(&format!("dists/{suite}/{rel}"));
            let da = arch.debian();
            out.push(Required {
                any_of: vec![vec![d("InRelease")], vec![d("Release"), d("Release.gpg")]],
            });
            // choose-mirror checks this file before it accepts the mirror.
            out.push(Required::one(d(&format!("main/binary-{da}/Release"))));
            // debootstrap and apt in the target read the package index.
            out.push(Required::either(
                [".gz", ".xz"].map(|x| d(&format!("main/binary-{da}/Packages{x}"))),
            ));
            // anna loads installer components (udebs) from here.
            out.push(Required::either([".gz", ".xz"].map(|x| {
                d(&format!("main/debian-installer/binary-{da}/Packages{x}"))
            })));
            // apt-get update in the target fails without the English translations.
            out.push(Required::either(
                [".bz2", ".xz", ".gz", ""].map(|x| d(&format!("main/i18n/Translation-en{x}"))),
            ));
        }
        Family::Kickstart => {
            out.push(Required::one(repo(".treeinfo")));
            out.push(Required::one(repo("repodata/repomd.xml")));
            for r in a.extra_repos.values() {
                out.push(Required::one(format!(
                    "{}/repodata/repomd.xml",
                    r.trim_end_matches('/')
                )));
            }
        }
        // casper fetches the live-server ISO from `url=` (the entry's `repo`).
        Family::Autoinstall => out.push(Required::one(a.repo.clone())),
        Family::Disk => {
            if let Some(m) = &a.disk_manifest {
                out.push(Required::one(m.clone()));
            }
            if let Some(d) = &a.disk {
                out.push(Required::one(d.clone()));
            }
        }
    }
    Ok(out)
}

/// One checked requirement: its URLs (alternatives) and whether the mirror has it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checked {
    /// The architecture it belongs to.
    pub arch: Arch,
    /// Full URLs per alternative, as [`Required::any_of`].
    pub any_of: Vec<Vec<String>>,
    /// Whether some alternative is complete on the mirror.
    pub present: bool,
    /// The URLs of the alternative the mirror has (empty when it has none).
    pub found: Vec<String>,
    /// Of the alternative closest to complete (else the first), the URLs the mirror
    /// lacks: what to name.
    pub missing: Vec<String>,
}

impl std::fmt::Display for Checked {
    /// `ok <url>` or `MISSING <url>`, with the alternatives after `or`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.present {
            write!(f, "ok {}", self.found.join(" + "))
        } else {
            write!(f, "MISSING {}", self.missing.join(" + "))?;
            let others: Vec<String> = self
                .any_of
                .iter()
                .filter(|g| !self.missing.iter().any(|m| g.contains(m)))
                .map(|g| g.join(" + "))
                .collect();
            if !others.is_empty() {
                write!(f, " (or {})", others.join(" or "))?;
            }
            Ok(())
        }
    }
}

/// Whether `url` exists: a HEAD (then a GET, for servers that refuse HEAD) answered
/// 2xx, or a regular file. An unreachable server is an error, not a missing file.
async fn exists(client: &reqwest::Client, url: &str) -> Result<bool, ImageError> {
    match source_for(url)? {
        Source::Http(u) => {
            let fetch = |source| ImageError::Fetch {
                url: u.clone(),
                source,
            };
            let resp = client.head(&u).send().await.map_err(fetch)?;
            if resp.status().is_success() {
                return Ok(true);
            }
            if !matches!(resp.status().as_u16(), 405 | 501) {
                return Ok(false);
            }
            let resp = client.get(&u).send().await.map_err(fetch)?;
            Ok(resp.status().is_success())
        }
        Source::File(p) => Ok(tokio::fs::metadata(&p).await.is_ok_and(|m| m.is_file())),
    }
}

/// Checks that `mirror_base` holds everything [`required_paths`] lists for each
/// architecture of `def` (only `arch` when given); an item several architectures
/// share is checked, and listed, once (under the first).
pub async fn check_mirror(
    def: &ImageDef,
    arch: Option<Arch>,
    mirror_base: &str,
) -> Result<Vec<Checked>, ImageError> {
    let client = http_client()?;
    let arches: Vec<Arch> = match arch {
        Some(a) => {
            def.arch(a)?;
            vec![a]
        }
        None => def.arches.keys().copied().collect(),
    };
    let mut out = Vec::new();
    // The release file and translations serve every architecture: check them once.
    let mut seen = std::collections::BTreeSet::new();
    for arch in arches {
        for req in required_paths(def, arch)? {
            if !seen.insert(req.any_of.clone()) {
                continue;
            }
            let any_of: Vec<Vec<String>> = req
                .any_of
                .iter()
                .map(|g| g.iter().map(|p| mirror_url(mirror_base, p)).collect())
                .collect();
            let mut present = false;
            let mut found = Vec::new();
            let mut missing: Vec<String> = Vec::new();
            let mut best = (true, usize::MAX);
            for group in &any_of {
                let mut lacks = Vec::new();
                for url in group {
                    if !exists(&client, url).await? {
                        lacks.push(url.clone());
                    }
                }
                if lacks.is_empty() {
                    present = true;
                    found = group.clone();
                    missing.clear();
                    break;
                }
                // Name the alternative closest to complete: `Release.gpg` when only
                // the signature is missing, not `InRelease`.
                let score = (lacks.len() == group.len(), lacks.len());
                if score < best {
                    best = score;
                    missing = lacks;
                }
            }
            out.push(Checked {
                arch,
                any_of,
                present,
                found,
                missing,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn catalog_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("images")
    }

    #[test]
    fn shipped_catalog_loads() {
        let cat = load_catalog(&catalog_dir()).unwrap();
        let names: Vec<&str> = cat.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "debian-12-installer",
                "debian-12",
                "debian-13",
                "rocky-9",
                "ubuntu-24.04"
            ]
        );
        for d in cat.iter().filter(|d| d.family != Family::Disk) {
            for arch in Arch::ALL {
                assert!(d.arches.contains_key(&arch), "{} lacks {arch}", d.name);
            }
        }
        let rocky = cat.iter().find(|d| d.name == "rocky-9").unwrap();
        assert_eq!(rocky.family, Family::Kickstart);
        assert_eq!(
            rocky.arches[&Arch::X86_64].kernel,
            "rocky/9/BaseOS/x86_64/os/images/pxeboot/vmlinuz"
        );
        let disk = cat.iter().find(|d| d.name == "debian-12").unwrap();
        assert_eq!(disk.family, Family::Disk);
        assert_eq!(
            disk.arches[&Arch::X86_64].disk.as_deref(),
            Some("debian-12-amd64.raw.zst")
        );
        let deb = cat.iter().find(|d| d.name == "debian-13").unwrap();
        assert_eq!(
            deb.arches[&Arch::Arm64].kernel,
            "debian/dists/trixie/main/installer-arm64/current/images/netboot/debian-installer/arm64/linux"
        );
    }

    const GOOD: &str = r#"
name = "t"
family = "kickstart"
[arches.x86_64]
kernel = "a/vmlinuz"
initrd = "a/initrd.img"
repo = "a/"
"#;

    #[test]
    fn parse_ok_and_unknown_keys_fail() {
        let p = Path::new("t.toml");
        let d = parse_image(GOOD, p).unwrap();
        assert_eq!(d.arches[&Arch::X86_64].initrd, "a/initrd.img");
        let extra = GOOD.replace("repo = \"a/\"", "repo = \"a/\"\nkernal = \"x\"");
        assert!(matches!(
            parse_image(&extra, p),
            Err(ImageError::Parse { .. })
        ));
        let top = format!("colour = \"red\"\n{GOOD}");
        assert!(matches!(
            parse_image(&top, p),
            Err(ImageError::Parse { .. })
        ));
        let arch = GOOD.replace(Arch::X86_64.as_str(), "sparc");
        assert!(matches!(
            parse_image(&arch, p),
            Err(ImageError::Parse { .. })
        ));
    }

    #[test]
    fn paths_must_stay_relative() {
        let p = Path::new("t.toml");
        for bad in [
            "/etc/passwd",
            "a/../../etc",
            "http://evil/x",
            "./a",
            "a b",
            "",
            "a?x=1",
        ] {
            let t = GOOD.replace("a/vmlinuz", bad);
            match parse_image(&t, p) {
                Err(ImageError::Invalid { field, .. }) => {
                    assert_eq!(field, "arches.x86_64.kernel", "{bad}")
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
        let t = GOOD.replace("repo = \"a/\"", "repo = \"a/\"\nsha256_kernel = \"abc\"");
        assert!(matches!(
            parse_image(&t, p),
            Err(ImageError::Invalid { .. })
        ));
        let t = GOOD.replace("name = \"t\"", "name = \"../t\"");
        assert!(matches!(
            parse_image(&t, p),
            Err(ImageError::Invalid { .. })
        ));
    }

    #[test]
    fn duplicate_names_fail() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.toml"), GOOD).unwrap();
        std::fs::write(dir.path().join("b.toml"), GOOD).unwrap();
        std::fs::write(dir.path().join("README"), "not toml").unwrap();
        assert!(matches!(
            load_catalog(dir.path()),
            Err(ImageError::Duplicate { .. })
        ));
    }

    #[test]
    fn cmdlines_per_family() {
        let cat = load_catalog(&catalog_dir()).unwrap();
        let get = |n: &str| cat.iter().find(|d| d.name == n).unwrap();
        let cfg = "http://10.0.0.1/cfg/tok";
        let m = "http://mirror.lab/pub/";

        let ks = kernel_cmdline(get("rocky-9"), Arch::X86_64, m, cfg, "node-1", None).unwrap();
        let args: Vec<&str> = ks.split(' ').collect();
        assert!(
            args.contains(&"inst.ks=http://10.0.0.1/cfg/tok/kickstart"),
            "{ks}"
        );
        assert!(args.contains(&"inst.repo=http://mirror.lab/pub/rocky/9/BaseOS/x86_64/os/"));
        assert_eq!(args.last(), Some(&"console=ttyS0,115200"));

        let ub = kernel_cmdline(get("ubuntu-24.04"), Arch::Arm64, m, cfg, "node-1", None).unwrap();
        let args: Vec<&str> = ub.split(' ').collect();
        assert!(args.contains(&"autoinstall"), "{ub}");
        assert!(
            args.contains(&"ds=nocloud;s=http://10.0.0.1/cfg/tok/"),
            "{ub}"
        );
        assert!(
            args.iter()
                .any(|a| a.starts_with("url=http://mirror.lab/pub/")
                    && a.ends_with("-live-server-arm64.iso"))
        );
        assert_eq!(args.last(), Some(&"console=ttyAMA0,115200"));

        let pre = kernel_cmdline(get("debian-13"), Arch::X86_64, m, cfg, "node-1", None).unwrap();
        let args: Vec<&str> = pre.split(' ').collect();
        for want in [
            "auto=true",
            "priority=critical",
            "url=http://10.0.0.1/cfg/tok/preseed",
            "hostname=node-1",
        ] {
            assert!(args.contains(&want), "{want} missing from {pre}");
        }
    }

    #[test]
    fn cmdlines_point_installers_at_the_syslog_receiver() {
        let cat = load_catalog(&catalog_dir()).unwrap();
        let get = |n: &str| cat.iter().find(|d| d.name == n).unwrap();
        let (cfg, m, s) = (
            "http://10.0.0.1/cfg/tok",
            "http://mirror.lab/pub/",
            Some("10.0.0.1:514"),
        );
        let args = |name: &str, arch| {
            kernel_cmdline(get(name), arch, m, cfg, "node-1", s)
                .unwrap()
                .split(' ')
                .map(String::from)
                .collect::<Vec<_>>()
        };
        let ks = args("rocky-9", Arch::X86_64);
        assert!(
            ks.contains(&"inst.syslog=10.0.0.1:514".to_string()),
            "{ks:?}"
        );
        let pre = args("debian-13", Arch::X86_64);
        for want in [
            "log_host=10.0.0.1",
            "log_port=514",
            "DEBCONF_DEBUG=developer",
        ] {
            assert!(
                pre.contains(&want.to_string()),
                "{want} missing from {pre:?}"
            );
        }
        let ub = args("ubuntu-24.04", Arch::X86_64);
        assert!(
            !ub.iter()
                .any(|a| a.contains("syslog") || a.starts_with("log_")),
            "{ub:?}"
        );
        // Consoles stay last; without a receiver nothing is added.
        assert_eq!(
            pre.last().map(String::as_str),
            Some(Arch::X86_64.serial_console())
        );
        let bare = kernel_cmdline(get("debian-13"), Arch::X86_64, m, cfg, "node-1", None).unwrap();
        assert!(
            !bare.contains("log_host") && !bare.contains("DEBCONF_DEBUG"),
            "{bare}"
        );
    }

    #[test]
    fn cmdline_refuses_ipxe_syntax() {
        let mut d = parse_image(GOOD, Path::new("t")).unwrap();
        let e = kernel_cmdline(&d, Arch::X86_64, "http://m", "http://s/cfg/${x}", "h", None);
        assert!(matches!(e, Err(ImageError::UnsafeCmdline { .. })), "{e:?}");
        d.arches.get_mut(&Arch::X86_64).unwrap().cmdline = "quiet ; reboot".into();
        assert!(matches!(
            validate(&d),
            Err(ImageError::UnsafeCmdline { .. })
        ));
        let e = kernel_cmdline(&d, Arch::Arm64, "http://m", "http://s/cfg/t", "h", None);
        assert!(matches!(e, Err(ImageError::NoArch { .. })));
    }

    #[test]
    fn required_paths_per_family() {
        let cat = load_catalog(&catalog_dir()).unwrap();
        let get = |n: &str| cat.iter().find(|d| d.name == n).unwrap();
        let flat = |name: &str, arch| -> Vec<String> {
            required_paths(get(name), arch)
                .unwrap()
                .into_iter()
                .map(|r| {
                    r.any_of
                        .iter()
                        .map(|g| g.join("+"))
                        .collect::<Vec<_>>()
                        .join("|")
                })
                .collect()
        };
        let deb = flat("debian-12-installer", Arch::Arm64);
        let d = "debian/dists/bookworm";
        assert_eq!(
            deb[2..],
            [
                format!("{d}/InRelease|{d}/Release+{d}/Release.gpg"),
                format!("{d}/main/binary-arm64/Release"),
                format!("{d}/main/binary-arm64/Packages.gz|{d}/main/binary-arm64/Packages.xz"),
                format!(
                    "{d}/main/debian-installer/binary-arm64/Packages.gz|\
                     {d}/main/debian-installer/binary-arm64/Packages.xz"
                ),
                format!(
                    "{d}/main/i18n/Translation-en.bz2|{d}/main/i18n/Translation-en.xz|\
                     {d}/main/i18n/Translation-en.gz|{d}/main/i18n/Translation-en"
                ),
            ]
        );
        assert!(deb[0].ends_with("/arm64/linux") && deb[1].ends_with("/arm64/initrd.gz"));

        let r = "rocky/9/BaseOS/x86_64/os";
        assert_eq!(
            flat("rocky-9", Arch::X86_64),
            [
                format!("{r}/images/pxeboot/vmlinuz"),
                format!("{r}/images/pxeboot/initrd.img"),
                format!("{r}/.treeinfo"),
                format!("{r}/repodata/repomd.xml"),
                "rocky/9/AppStream/x86_64/os/repodata/repomd.xml".to_string(),
            ]
        );
        let ub = flat("ubuntu-24.04", Arch::X86_64);
        assert_eq!(ub.len(), 3);
        assert!(
            ub[2].ends_with("ubuntu-24.04.3-live-server-amd64.iso"),
            "{ub:?}"
        );
        assert_eq!(
            flat("debian-12", Arch::X86_64),
            [
                "deploy-amd64/kernel",
                "deploy-amd64/initrd",
                "debian-12-amd64.json",
                "debian-12-amd64.raw.zst"
            ]
        );
        // A preseed entry whose kernel names no suite cannot be checked.
        let mut bad = get("debian-13").clone();
        bad.arches.get_mut(&Arch::X86_64).unwrap().kernel = "linux".into();
        assert!(matches!(
            required_paths(&bad, Arch::X86_64),
            Err(ImageError::Invalid { .. })
        ));
        assert!(matches!(
            required_paths(get("debian-12"), Arch::Arm64),
            Err(ImageError::NoArch { .. })
        ));
    }

    #[tokio::test]
    async fn check_names_what_the_mirror_lacks() {
        let mirror = tempfile::tempdir().unwrap();
        let mut d = parse_image(GOOD, Path::new("t")).unwrap();
        d.arches.get_mut(&Arch::X86_64).unwrap().repo = "a/os/".into();
        for f in ["a/vmlinuz", "a/initrd.img", "a/os/.treeinfo"] {
            let p = mirror.path().join(f);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, b"x").unwrap();
        }
        let base = mirror.path().to_str().unwrap();
        let got = check_mirror(&d, None, base).await.unwrap();
        let lines: Vec<String> = got.iter().map(|c| c.to_string()).collect();
        assert_eq!(
            lines,
            [
                format!("ok {base}/a/vmlinuz"),
                format!("ok {base}/a/initrd.img"),
                format!("ok {base}/a/os/.treeinfo"),
                format!("MISSING {base}/a/os/repodata/repomd.xml"),
            ]
        );
        let e = check_mirror(&d, Some(Arch::Arm64), base).await;
        assert!(matches!(e, Err(ImageError::NoArch { .. })), "{e:?}");
    }

    /// Over HTTP: a server that refuses HEAD is asked with GET; a 404 is missing; a
    /// server nothing answers at is an error, not a list of missing files.
    #[tokio::test]
    async fn check_over_http_falls_back_to_get() {
        use axum::http::{Method, StatusCode, Uri};
        async fn serve(method: Method, uri: Uri) -> StatusCode {
            match (method, uri.path()) {
                (Method::HEAD, _) => StatusCode::METHOD_NOT_ALLOWED,
                (_, "/a/vmlinuz" | "/a/initrd.img" | "/a/os/.treeinfo") => StatusCode::OK,
                _ => StatusCode::NOT_FOUND,
            }
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}/", listener.local_addr().unwrap());
        let app = axum::Router::new().fallback(serve);
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        let mut d = parse_image(GOOD, Path::new("t")).unwrap();
        d.arches.get_mut(&Arch::X86_64).unwrap().repo = "a/os/".into();
        let got = check_mirror(&d, None, &base).await.unwrap();
        let lines: Vec<String> = got.iter().map(|c| c.to_string()).collect();
        assert_eq!(
            lines,
            [
                format!("ok {base}a/vmlinuz"),
                format!("ok {base}a/initrd.img"),
                format!("ok {base}a/os/.treeinfo"),
                format!("MISSING {base}a/os/repodata/repomd.xml"),
            ]
        );
        server.abort();
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            format!("http://{}/", l.local_addr().unwrap())
        };
        let e = check_mirror(&d, None, &closed).await;
        assert!(matches!(e, Err(ImageError::Fetch { .. })), "{e:?}");
    }

    #[test]
    fn mirror_urls() {
        assert_eq!(mirror_url("http://m/x/", "/a/b"), "http://m/x/a/b");
    }

    #[tokio::test]
    async fn import_from_plain_path_and_mismatch() {
        let mirror = tempfile::tempdir().unwrap();
        let out = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(mirror.path().join("a")).unwrap();
        std::fs::write(mirror.path().join("a/vmlinuz"), b"kernel").unwrap();
        std::fs::write(mirror.path().join("a/initrd.img"), b"initrd!").unwrap();
        let mut d = parse_image(GOOD, Path::new("t")).unwrap();
        let base = mirror.path().to_str().unwrap();
        let got = import(&d, base, out.path()).await.unwrap();
        let k = &got.arches[&Arch::X86_64].kernel;
        assert_eq!(k.size, 6);
        assert_eq!(k.sha256, hex::encode(Sha256::digest(b"kernel")));
        assert_eq!(
            std::fs::read(out.path().join("t/x86_64/kernel")).unwrap(),
            b"kernel"
        );

        d.arches.get_mut(&Arch::X86_64).unwrap().sha256_initrd = Some("0".repeat(64));
        let e = import(&d, &format!("file://{base}"), out.path()).await;
        assert!(
            matches!(e, Err(ImageError::ChecksumMismatch { .. })),
            "{e:?}"
        );
        assert!(!out.path().join("t/x86_64/initrd.partial").exists());
        // The earlier verified file stays; the bad download never replaced it.
        assert_eq!(
            std::fs::read(out.path().join("t/x86_64/initrd")).unwrap(),
            b"initrd!"
        );
    }
}
