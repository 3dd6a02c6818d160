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
