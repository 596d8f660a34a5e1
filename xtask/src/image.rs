//! `cargo xtask image`: weir's container image, written here from the release binaries, with no
//! base image and no container engine. Its one layer holds weir-agent (the entrypoint), weir-cni
//! beside it (the agent installs the plugin from next to itself), both without debug info, and
//! the shared libraries weir-agent loads, at the paths where ldd finds them on this machine.
//! Nothing else: the agent runs no other program. weir-cni is linked statically against musl: the
//! runtime runs it on the node, whose libc (glibc of any age, musl, none) is not the image's.
//!
//! The archive is an OCI image layout and a docker-archive at once, over the same blobs, as
//! `docker save` writes it since Docker 25: `ctr images import`, `docker load` and `podman load`
//! all read it. Every time in it is the Unix epoch, so the same binaries make the same archive.

use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use flate2::{write::GzEncoder, Compression};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::{ebpf, step, system};

/// The image's repository, as deploy/weir.yaml names it. Fully qualified, so every runtime stores
/// the image under this very name: a short name becomes `docker.io/library/...` in Docker and
/// containerd, but `localhost/...` in podman.
pub const REPOSITORY: &str = "localhost/weir-agent";
/// Where `cargo xtask test` tells the image test to find the archive.
pub const ARCHIVE_ENV: &str = "WEIR_IMAGE_ARCHIVE";
const AGENT: &str = "weir-agent";
const PLUGIN: &str = "weir-cni";
const BIN_DIR: &str = "usr/local/bin";
const ENTRYPOINT: &str = "/usr/local/bin/weir-agent";
/// The Unix epoch, for every time the archive records.
const EPOCH: &str = "1970-01-01T00:00:00Z";

const INDEX_MEDIA_TYPE: &str = "application/vnd.oci.image.index.v1+json";
const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
const CONFIG_MEDIA_TYPE: &str = "application/vnd.oci.image.config.v1+json";
const LAYER_MEDIA_TYPE: &str = "application/vnd.oci.image.layer.v1.tar+gzip";

/// `localhost/weir-agent:<version of this workspace>`.
pub fn reference() -> String {
    format!("{REPOSITORY}:{}", env!("CARGO_PKG_VERSION"))
}

/// `cargo xtask image`.
pub fn run() -> Result<()> {
    let object = ebpf::build(false)?;
    let archive = build(&object)?;
    let size = fs::metadata(&archive)?.len();
    println!(
        "{}: {} ({:.1} MiB)",
        reference(),
        archive.display(),
        size as f64 / (1024.0 * 1024.0)
    );
    Ok(())
}

/// Builds weir-agent and weir-cni (release, with the eBPF `object` embedded) and writes the image
/// archive, `<target dir>/image/weir-agent.tar`; returns its path.
pub fn build(object: &Path) -> Result<PathBuf> {
    step("building weir-agent and weir-cni (release) for the image");
    // Only these two packages: built with the test harness, weir-agent would get its
    // fault-injection points (cargo unifies features).
    system::run(
        system::cargo()
            .current_dir(crate::workspace_root())
            .args(["build", "--release", "-p", AGENT, "--bins"])
            .env("WEIR_EBPF_OBJECT", object),
    )?;
    let target = crate::target_dir()?;
    let binaries = [
        (AGENT, target.join("release").join(AGENT)),
        (PLUGIN, build_static_plugin(&target)?),
    ];
    let image_dir = target.join("image");
    let stripped_dir = image_dir.join("bin");
    fs::create_dir_all(&stripped_dir)?;
    let mut files = BTreeMap::new();
    for (binary, built) in binaries {
        for library in shared_libraries(&built)? {
            files.insert(image_path(&library)?, library);
        }
        let stripped = stripped_dir.join(binary);
        strip_debug_info(&built, &stripped)?;
        files.insert(format!("{BIN_DIR}/{binary}"), stripped);
    }
    step(&format!("writing the image {}", reference()));
    let archive = image_dir.join("weir-agent.tar");
    let partial = archive.with_extension("tar.partial");
    let image = Image::new(&files, &reference(), oci_architecture()?)?;
    image
        .write(std::io::BufWriter::new(fs::File::create(&partial)?))
        .with_context(|| format!("writing {}", partial.display()))?;
    fs::rename(&partial, &archive)?;
    Ok(archive)
}

/// Builds weir-cni for this machine's architecture with musl, statically linked; returns its path.
/// Needs the Rust target (added with rustup) and a C compiler for musl (ring's C code): Debian's
/// musl-tools.
pub fn build_static_plugin(target_dir: &Path) -> Result<PathBuf> {
    let triple = format!("{}-unknown-linux-musl", std::env::consts::ARCH);
    step(&format!("building {PLUGIN} (release, static, {triple})"));
    system::ensure_packages(&["musl-tools"], "weir-cni cannot be built for musl")?;
    system::run(Command::new("rustup").args(["target", "add", &triple]))
        .with_context(|| format!("adding the Rust target {triple}"))?;
    system::run(
        system::cargo()
            .current_dir(crate::workspace_root())
            .args(["build", "--release", "-p", PLUGIN, "--bin", PLUGIN])
            .args(["--target", &triple]),
    )?;
    Ok(target_dir.join(triple).join("release").join(PLUGIN))
}

/// A copy of `binary` without the debug info that the release profile keeps (most of the file),
/// with its symbols, so that a backtrace still names functions.
fn strip_debug_info(binary: &Path, copy: &Path) -> Result<()> {
    system::run(
        Command::new("objcopy")
            .arg("--strip-debug")
            .arg(binary)
            .arg(copy),
    )
    .context("stripping debug info with objcopy (Debian's binutils)")
}

/// The shared libraries `binary` loads, the dynamic loader among them, as ldd resolves them on
/// this machine; none for a static binary.
fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(binary)
        .output()
        .context("cannot run ldd (Debian's libc-bin)")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        if String::from_utf8_lossy(&out.stderr).contains("not a dynamic executable") {
            return Ok(Vec::new());
        }
        bail!(
            "ldd {} failed: {}\n{}",
            binary.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    parse_ldd(&stdout).with_context(|| format!("the libraries of {}", binary.display()))
}

/// The files in ldd's listing: `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)` and
/// `/lib64/ld-linux-x86-64.so.2 (0x...)` name one; `linux-vdso.so.1 (0x...)` is the kernel's.
fn parse_ldd(listing: &str) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for line in listing
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty())
    {
        let loaded = match line.split_once("=>") {
            Some((name, target)) => {
                if target.trim() == "not found" {
                    bail!("{} is not found", name.trim());
                }
                target
            }
            None => line,
        };
        let path = loaded.split_whitespace().next().unwrap_or_default();
        if path.starts_with('/') {
            files.push(PathBuf::from(path));
        }
    }
    Ok(files)
}

/// Where a file of this machine goes in the image: at the same path, relative to the layer's root.
fn image_path(file: &Path) -> Result<String> {
    let relative = file
        .strip_prefix("/")
        .with_context(|| format!("{} is not an absolute path", file.display()))?;
    relative
        .to_str()
        .map(str::to_owned)
        .with_context(|| format!("{} is not UTF-8", file.display()))
}

/// The OCI name of this machine's architecture, which the binaries are built for.
fn oci_architecture() -> Result<&'static str> {
    match std::env::consts::ARCH {
        "x86_64" => Ok("amd64"),
        "aarch64" => Ok("arm64"),
        other => bail!("no OCI architecture name for {other}"),
    }
}

/// Content, named by its digest.
struct Blob {
    bytes: Vec<u8>,
    /// `sha256:<hex>`.
    digest: String,
}

impl Blob {
    fn new(bytes: Vec<u8>) -> Self {
        let digest = sha256(&bytes);
        Self { bytes, digest }
    }

    fn of_json(value: &Value) -> Self {
        Self::new(serde_json::to_vec(value).expect("JSON values serialize"))
    }

    /// Its path in the archive, under `blobs/`.
    fn path(&self) -> String {
        format!("blobs/{}", self.digest.replacen(':', "/", 1))
    }

    /// An OCI descriptor of it.
    fn descriptor(&self, media_type: &str) -> Value {
        json!({"mediaType": media_type, "digest": self.digest, "size": self.bytes.len()})
    }
}

fn sha256(bytes: &[u8]) -> String {
    let hash = Sha256::digest(bytes);
    let hex: String = hash.iter().map(|byte| format!("{byte:02x}")).collect();
    format!("sha256:{hex}")
}

/// The image's blobs: its layer, configuration and manifest.
struct Image {
    reference: String,
    architecture: &'static str,
    layer: Blob,
    config: Blob,
    manifest: Blob,
}

impl Image {
    /// The image of `files` (path in the image → file on this machine), named `reference`.
    fn new(
        files: &BTreeMap<String, PathBuf>,
        reference: &str,
        architecture: &'static str,
    ) -> Result<Self> {
        let layer_tar = layer_tar(files)?;
        let diff_id = sha256(&layer_tar);
        let mut gzip = GzEncoder::new(Vec::new(), Compression::best());
        gzip.write_all(&layer_tar)?;
        let layer = Blob::new(gzip.finish()?);
        let config = Blob::of_json(&json!({
            "architecture": architecture,
            "os": "linux",
            "created": EPOCH,
            "config": {"Entrypoint": [ENTRYPOINT], "Cmd": ["run"]},
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
            "history": [{"created": EPOCH, "created_by": "cargo xtask image"}],
        }));
        let manifest = Blob::of_json(&json!({
            "schemaVersion": 2,
            "mediaType": MANIFEST_MEDIA_TYPE,
            "config": config.descriptor(CONFIG_MEDIA_TYPE),
            "layers": [layer.descriptor(LAYER_MEDIA_TYPE)],
        }));
        Ok(Self {
            reference: reference.to_owned(),
            architecture,
            layer,
            config,
            manifest,
        })
    }

    /// The archive: the OCI layout's `oci-layout` and `index.json`, docker-archive's
    /// `manifest.json` and `repositories`, and the blobs both point to.
    fn write(&self, out: impl Write) -> Result<()> {
        let (repository, tag) = self
            .reference
            .rsplit_once(':')
            .context("the image reference has no tag")?;
        let mut manifest_descriptor = self.manifest.descriptor(MANIFEST_MEDIA_TYPE);
        manifest_descriptor["platform"] = json!({"architecture": self.architecture, "os": "linux"});
        // containerd names the image by the first, podman by the second; both the full name.
        manifest_descriptor["annotations"] = json!({
            "io.containerd.image.name": self.reference,
            "org.opencontainers.image.ref.name": self.reference,
        });
        let index = json!({
            "schemaVersion": 2,
            "mediaType": INDEX_MEDIA_TYPE,
            "manifests": [manifest_descriptor],
        });
        let docker_manifest = json!([{
            "Config": self.config.path(),
            "RepoTags": [self.reference],
            "Layers": [self.layer.path()],
        }]);
        // The legacy name → top layer map, as Docker still writes it.
        let layer_hex = self.layer.digest.trim_start_matches("sha256:");
        let repositories = json!({repository: {tag: layer_hex}});

        let mut archive = tar::Builder::new(out);
        let json_file = |value: &Value| serde_json::to_vec(value).expect("JSON values serialize");
        for dir in ["blobs/", "blobs/sha256/"] {
            append(&mut archive, dir, None)?;
        }
        for blob in [&self.layer, &self.config, &self.manifest] {
            append(&mut archive, &blob.path(), Some((0o644, &blob.bytes)))?;
        }
        let oci_layout = json_file(&json!({"imageLayoutVersion": "1.0.0"}));
        for (path, bytes) in [
            ("oci-layout", oci_layout),
            ("index.json", json_file(&index)),
            ("manifest.json", json_file(&docker_manifest)),
            ("repositories", json_file(&repositories)),
        ] {
            append(&mut archive, path, Some((0o644, &bytes)))?;
        }
        archive.into_inner()?.flush()?;
        Ok(())
    }
}

/// The layer's tar: `files` (path in the image → file on this machine, read through symlinks)
/// with their modes, and the directories they are in (0755), parents first; owned by root, at
/// the epoch.
fn layer_tar(files: &BTreeMap<String, PathBuf>) -> Result<Vec<u8>> {
    let mut entries: BTreeMap<String, Option<&Path>> = BTreeMap::new();
    for (path, source) in files {
        for dir in Path::new(path).ancestors().skip(1) {
            if let Some(dir) = dir.to_str().filter(|dir| !dir.is_empty()) {
                entries.insert(format!("{dir}/"), None);
            }
        }
        entries.insert(path.clone(), Some(source));
    }
    // A directory's path is a prefix of its files' paths, so it sorts before them.
    let mut layer = tar::Builder::new(Vec::new());
    for (path, source) in entries {
        match source {
            None => append(&mut layer, &path, None)?,
            Some(source) => {
                let mut bytes = Vec::new();
                fs::File::open(source)
                    .and_then(|mut file| file.read_to_end(&mut bytes))
                    .with_context(|| format!("reading {}", source.display()))?;
                let mode = fs::metadata(source)?.permissions().mode() & 0o7777;
                append(&mut layer, &path, Some((mode, &bytes)))?;
            }
        }
    }
    Ok(layer.into_inner()?)
}

/// A directory (`file` none) or a file with its mode and content, owned by root, at the epoch.
fn append<W: Write>(
    archive: &mut tar::Builder<W>,
    path: &str,
    file: Option<(u32, &[u8])>,
) -> Result<()> {
    let mut header = tar::Header::new_ustar();
    header.set_uid(0);
    header.set_gid(0);
    header.set_mtime(0);
    let content: &[u8] = match file {
        None => {
            header.set_entry_type(tar::EntryType::Directory);
            header.set_mode(0o755);
            &[]
        }
        Some((mode, bytes)) => {
            header.set_entry_type(tar::EntryType::Regular);
            header.set_mode(mode);
            bytes
        }
    };
    header.set_size(content.len() as u64);
    archive
        .append_data(&mut header, path, content)
        .with_context(|| format!("adding {path} to the archive"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use flate2::read::GzDecoder;

    /// The archive's files, by path.
    fn entries(archive: &[u8]) -> BTreeMap<String, (tar::Header, Vec<u8>)> {
        let mut entries = BTreeMap::new();
        for entry in tar::Archive::new(archive).entries().unwrap() {
            let mut entry = entry.unwrap();
            let path = entry.path().unwrap().to_string_lossy().into_owned();
            let mut bytes = Vec::new();
            entry.read_to_end(&mut bytes).unwrap();
            entries.insert(path, (entry.header().clone(), bytes));
        }
        entries
    }

    fn json_at(entries: &BTreeMap<String, (tar::Header, Vec<u8>)>, path: &str) -> Value {
        serde_json::from_slice(&entries[path].1).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    /// The blob a descriptor points to, checked against its digest and size.
    fn blob<'a>(
        entries: &'a BTreeMap<String, (tar::Header, Vec<u8>)>,
        descriptor: &Value,
    ) -> &'a [u8] {
        let digest = descriptor["digest"].as_str().unwrap();
        let path = format!("blobs/{}", digest.replacen(':', "/", 1));
        let bytes = &entries[&path].1;
        assert_eq!(sha256(bytes), digest, "{path} is what its name says");
        assert_eq!(descriptor["size"], bytes.len());
        bytes
    }

    /// The image of a fake agent and libc.
    fn test_image() -> Vec<u8> {
        let dir = tempfile::tempdir().unwrap();
        let file = |name: &str, content: &[u8], mode: u32| {
            let path = dir.path().join(name);
            fs::write(&path, content).unwrap();
            fs::set_permissions(&path, fs::Permissions::from_mode(mode)).unwrap();
            path
        };
        let files = BTreeMap::from([
            (
                "usr/local/bin/weir-agent".to_owned(),
                file("weir-agent", b"agent", 0o755),
            ),
            (
                "lib/x86_64-linux-gnu/libc.so.6".to_owned(),
                file("libc.so.6", b"libc", 0o644),
            ),
        ]);
        let mut archive = Vec::new();
        Image::new(&files, "localhost/weir-agent:1.2.3", "amd64")
            .unwrap()
            .write(&mut archive)
            .unwrap();
        archive
    }

    #[test]
    fn the_oci_layout_and_the_docker_archive_name_the_same_blobs() {
        let archive = test_image();
        let entries = entries(&archive);
        assert_eq!(
            json_at(&entries, "oci-layout"),
            json!({"imageLayoutVersion": "1.0.0"})
        );

        let index = json_at(&entries, "index.json");
        let descriptors = index["manifests"].as_array().unwrap();
        assert_eq!(descriptors.len(), 1);
        let annotations = &descriptors[0]["annotations"];
        assert_eq!(
            annotations["io.containerd.image.name"],
            "localhost/weir-agent:1.2.3"
        );
        assert_eq!(
            annotations["org.opencontainers.image.ref.name"],
            "localhost/weir-agent:1.2.3"
        );
        let manifest: Value = serde_json::from_slice(blob(&entries, &descriptors[0])).unwrap();
        assert_eq!(manifest["mediaType"], MANIFEST_MEDIA_TYPE);
        let config_bytes = blob(&entries, &manifest["config"]);
        let config: Value = serde_json::from_slice(config_bytes).unwrap();
        let layers = manifest["layers"].as_array().unwrap();
        assert_eq!(layers.len(), 1);
        let layer = blob(&entries, &layers[0]);

        // The layer's diff_id is the digest of the uncompressed tar.
        let mut layer_tar = Vec::new();
        GzDecoder::new(layer).read_to_end(&mut layer_tar).unwrap();
        assert_eq!(config["rootfs"]["diff_ids"], json!([sha256(&layer_tar)]));
        assert_eq!(
            config["config"]["Entrypoint"],
            json!(["/usr/local/bin/weir-agent"])
        );
        assert_eq!(config["architecture"], "amd64");

        let docker = json_at(&entries, "manifest.json");
        let config_path = format!("blobs/{}", manifest["config"]["digest"].as_str().unwrap());
        assert_eq!(docker[0]["Config"], config_path.replacen(':', "/", 1));
        let layer_path = format!("blobs/{}", layers[0]["digest"].as_str().unwrap());
        assert_eq!(
            docker[0]["Layers"],
            json!([layer_path.replacen(':', "/", 1)])
        );
        assert_eq!(docker[0]["RepoTags"], json!(["localhost/weir-agent:1.2.3"]));
        let layer_hex = layers[0]["digest"].as_str().unwrap().replace("sha256:", "");
        assert_eq!(
            json_at(&entries, "repositories"),
            json!({"localhost/weir-agent": {"1.2.3": layer_hex}})
        );
    }

    #[test]
    fn the_layer_holds_the_files_and_their_directories_owned_by_root_at_the_epoch() {
        let archive = test_image();
        let entries = entries(&archive);
        let index = json_at(&entries, "index.json");
        let manifest: Value =
            serde_json::from_slice(blob(&entries, &index["manifests"][0])).unwrap();
        let mut layer_tar = Vec::new();
        GzDecoder::new(blob(&entries, &manifest["layers"][0]))
            .read_to_end(&mut layer_tar)
            .unwrap();
        let mut listed = Vec::new();
        for entry in tar::Archive::new(layer_tar.as_slice()).entries().unwrap() {
            let mut entry = entry.unwrap();
            let header = entry.header();
            assert_eq!(
                (header.uid().unwrap(), header.gid().unwrap()),
                (0, 0),
                "root's"
            );
            assert_eq!(header.mtime().unwrap(), 0);
            let path = entry.path().unwrap().to_string_lossy().into_owned();
            let mode = header.mode().unwrap();
            let mut content = String::new();
            entry.read_to_string(&mut content).unwrap();
            listed.push((path, mode, content));
        }
        let expected = [
            ("lib/", 0o755, ""),
            ("lib/x86_64-linux-gnu/", 0o755, ""),
            ("lib/x86_64-linux-gnu/libc.so.6", 0o644, "libc"),
            ("usr/", 0o755, ""),
            ("usr/local/", 0o755, ""),
            ("usr/local/bin/", 0o755, ""),
            ("usr/local/bin/weir-agent", 0o755, "agent"),
        ]
        .map(|(path, mode, content)| (path.to_owned(), mode, content.to_owned()));
        assert_eq!(listed, expected);
    }

    #[test]
    fn the_same_files_make_the_same_archive() {
        assert_eq!(test_image(), test_image());
    }

    #[test]
    fn ldd_listing_names_the_loader_and_the_libraries_not_the_vdso() {
        let listing = "\tlinux-vdso.so.1 (0x00007ffc2b5f4000)
\tlibgcc_s.so.1 => /lib/x86_64-linux-gnu/libgcc_s.so.1 (0x00007f0b1c6a0000)
\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f0b1c4bf000)
\t/lib64/ld-linux-x86-64.so.2 (0x00007f0b1c6e9000)
";
        assert_eq!(
            parse_ldd(listing).unwrap(),
            [
                "/lib/x86_64-linux-gnu/libgcc_s.so.1",
                "/lib/x86_64-linux-gnu/libc.so.6",
                "/lib64/ld-linux-x86-64.so.2",
            ]
            .map(PathBuf::from)
        );
        let missing = "\tlibfoo.so.1 => not found\n";
        assert!(parse_ldd(missing).is_err());
    }
}
