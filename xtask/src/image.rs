//! `cargo xtask image`: weir's container image, written here from the release binaries (the
//! tests' image from the same sources unoptimized), with no base image and no container engine,
//! for amd64 and arm64 under one image index (this machine's architecture built natively, the
//! other cross-compiled with Debian's cross toolchain; the eBPF object is the same). Each
//! platform's one layer holds weir-agent (the entrypoint), weir-cni beside it (the agent installs
//! the plugin from next to itself), kubectl-weir (for operators to copy out), all without debug
//! info, and the shared libraries weir-agent loads, where that platform's loader finds them.
//! Nothing else: the agent runs no other program. weir-cni and kubectl-weir are linked
//! statically against musl: the runtime runs the plugin on the node, and an operator the kubectl
//! plugin on a workstation, whose libc (glibc of any age, musl, none) is not the image's.
//!
//! The archive is an OCI image layout and a docker-archive at once, over the same blobs, as
//! `docker save` writes it since Docker 25: `ctr images import` reads the index (and unpacks its
//! own platform's image), `docker load` and `podman load` the docker-archive, which names this
//! machine's image. Every time in it is the Unix
//! epoch, so the same binaries make the same archive.

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsStr;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::str::FromStr;

use anyhow::{bail, Context, Result};
use flate2::{write::GzEncoder, Compression};
use object::{
    elf,
    read::elf::{FileHeader, ProgramHeader},
    Endianness,
};
use oci_spec::image::{
    Arch, ConfigBuilder, Descriptor, DescriptorBuilder, Digest, HistoryBuilder,
    ImageConfigurationBuilder, ImageIndex, ImageIndexBuilder, ImageManifestBuilder, MediaType,
    OciLayoutBuilder, Os, PlatformBuilder, RootFsBuilder,
};
use serde::Serialize;
use serde_json::json;
use sha2::{Digest as _, Sha256};

use crate::{ebpf, step, system};

/// The image's repository, as deploy/weir.yaml names it. Fully qualified, so every runtime stores
/// the image under this very name: a short name becomes `docker.io/library/...` in Docker and
/// containerd, but `localhost/...` in podman.
pub const REPOSITORY: &str = "localhost/weir-agent";
/// Where `cargo xtask test` tells the image test to find the archive.
pub const ARCHIVE_ENV: &str = "WEIR_IMAGE_ARCHIVE";
const AGENT: &str = "weir-agent";
const PLUGIN: &str = "weir-cni";
const KUBECTL_PLUGIN: &str = "kubectl-weir";
const BIN_DIR: &str = "usr/local/bin";
const ENTRYPOINT: &str = "/usr/local/bin/weir-agent";
/// The Unix epoch, for every time the archive records.
const EPOCH: &str = "1970-01-01T00:00:00Z";
/// The OCI image spec's `schemaVersion` for manifests and indexes.
const SCHEMA_VERSION: u32 = 2;

/// `localhost/weir-agent:<version of this workspace>`.
pub fn reference() -> String {
    format!("{REPOSITORY}:{}", env!("CARGO_PKG_VERSION"))
}

/// `cargo xtask image`.
pub fn run() -> Result<()> {
    let object = ebpf::build(false)?;
    let archive = build(&object, Profile::Release, None)?;
    let size = fs::metadata(&archive)?.len();
    println!(
        "{}: {} ({:.1} MiB)",
        reference(),
        archive.display(),
        size as f64 / (1024.0 * 1024.0)
    );
    Ok(())
}

/// An architecture the image holds binaries for.
#[derive(Clone, Copy, Debug)]
pub struct Platform {
    /// Rust's name, which is also the first part of Debian's multiarch triple.
    pub arch: &'static str,
    /// The OCI name (also Debian's).
    pub oci: &'static str,
}

/// Every platform of the image; this machine's is built natively, the others cross-compiled
/// (the eBPF object is the same for all).
pub const PLATFORMS: [Platform; 2] = [
    Platform {
        arch: "x86_64",
        oci: "amd64",
    },
    Platform {
        arch: "aarch64",
        oci: "arm64",
    },
];

impl Platform {
    fn is_native(self) -> bool {
        self.arch == std::env::consts::ARCH
    }

    /// Debian's multiarch triple: `x86_64-linux-gnu`.
    fn multiarch(self) -> String {
        format!("{}-linux-gnu", self.arch)
    }

    /// Where this machine keeps the platform's glibc: its own, or Debian's cross copy.
    fn library_dirs(self) -> Vec<PathBuf> {
        let multiarch = self.multiarch();
        if self.is_native() {
            vec![
                Path::new("/lib").join(&multiarch),
                Path::new("/usr/lib").join(&multiarch),
            ]
        } else {
            vec![Path::new("/usr").join(&multiarch).join("lib")]
        }
    }

    fn triple(self, libc: Libc) -> String {
        format!("{}-unknown-linux-{}", self.arch, libc.name())
    }

    /// The C compiler for the platform's `libc` target (ring's C code needs one), and the Debian
    /// packages it takes; none for this machine's glibc. weir-agent links with it too; weir-cni
    /// links with rust-lld, against Rust's own musl.
    fn c_compiler(self, libc: Libc) -> Option<(String, Vec<String>)> {
        if self.is_native() {
            return match libc {
                Libc::Gnu => None,
                Libc::Musl => Some((
                    format!("{}-linux-musl-gcc", self.arch),
                    vec!["musl-tools".to_owned()],
                )),
            };
        }
        let mut packages = vec![format!("gcc-{}", self.multiarch().replace('_', "-"))];
        if let Libc::Gnu = libc {
            packages.push(format!("libc6-dev-{}-cross", self.oci));
        }
        Some((format!("{}-gcc", self.multiarch()), packages))
    }

    /// The files of the platform's image: the binaries without debug info, and the shared
    /// libraries they load.
    fn files(self, binaries: &[(&str, &Path)]) -> Result<BTreeMap<String, PathBuf>> {
        let stripped_dir = crate::target_dir()?.join("image").join(self.oci);
        fs::create_dir_all(&stripped_dir)?;
        let mut files = BTreeMap::new();
        for &(binary, built) in binaries {
            files.extend(self.shared_libraries(built)?);
            let stripped = stripped_dir.join(binary);
            self.strip_debug_info(built, &stripped)?;
            files.insert(format!("{BIN_DIR}/{binary}"), stripped);
        }
        Ok(files)
    }

    /// A copy of `binary` without the debug info that the release profile keeps (most of the
    /// file), with its symbols, so that a backtrace still names functions. objcopy handles only
    /// its own architecture: a cross-compiled binary takes the cross binutils' (which come with
    /// the cross gcc).
    fn strip_debug_info(self, binary: &Path, copy: &Path) -> Result<()> {
        let objcopy = match self.is_native() {
            true => "objcopy".to_owned(),
            false => format!("{}-objcopy", self.multiarch()),
        };
        system::run(
            Command::new(&objcopy)
                .arg("--strip-debug")
                .arg(binary)
                .arg(copy),
        )
        .with_context(|| format!("stripping debug info with {objcopy} (Debian's binutils)"))
    }

    /// The dynamic loader and the shared libraries `binary` needs, and theirs (path in the
    /// image → file on this machine), found where the platform's loader looks: in
    /// `/lib/<multiarch>`, the dynamic loader at the path the binary names. None for a static
    /// binary.
    fn shared_libraries(self, binary: &Path) -> Result<BTreeMap<String, PathBuf>> {
        let mut files = BTreeMap::new();
        let linking = DynamicLinking::of(binary)?;
        let Some(interpreter) = linking.interpreter else {
            return Ok(files);
        };
        let interpreter_name = file_name(&interpreter)?;
        let source = if self.is_native() {
            interpreter.clone()
        } else {
            self.library_dirs()[0].join(&interpreter_name)
        };
        files.insert(image_path(&interpreter)?, source);
        let mut pending = linking.needed;
        while let Some(library) = pending.pop() {
            let image_path = format!("lib/{}/{library}", self.multiarch());
            if library == interpreter_name || files.contains_key(&image_path) {
                continue;
            }
            let source = self
                .library_dirs()
                .iter()
                .map(|dir| dir.join(&library))
                .find(|path| path.exists())
                .with_context(|| {
                    format!("{library}, which {} needs, is not found", binary.display())
                })?;
            pending.extend(DynamicLinking::of(&source)?.needed);
            files.insert(image_path, source);
        }
        Ok(files)
    }
}

/// The cargo profile the image's binaries are built with.
#[derive(Clone, Copy, Debug)]
pub enum Profile {
    /// As shipped (`cargo xtask image`).
    Release,
    /// For the tests: the same binaries unoptimized (see the `image-test` profile).
    Test,
}

impl Profile {
    /// Its name, which is also its directory under a target's.
    fn name(self) -> &'static str {
        match self {
            Self::Release => "release",
            Self::Test => "image-test",
        }
    }
}

/// The C library a binary of the image is linked with.
#[derive(Clone, Copy, Debug)]
enum Libc {
    /// weir-agent: the image carries the glibc it was linked with.
    Gnu,
    /// weir-cni, linked statically: the runtime runs it on the node, whatever the node's libc.
    Musl,
}

impl Libc {
    fn name(self) -> &'static str {
        match self {
            Self::Gnu => "gnu",
            Self::Musl => "musl",
        }
    }
}

/// Builds `packages` (each one's binary of its name) with `profile` for every platform in one
/// cargo run, in target dirs the image's builds have to themselves; returns each platform's
/// binaries, in the order of `packages`. One run, because then the platforms' builds share the
/// cores (one build alone leaves a core idle through its largest crates and its link) and build
/// scripts, proc macros and the packages' common dependencies are built once. `env` is for every
/// platform (the eBPF object weir-agent embeds).
fn build_for_platforms(
    platforms: &[Platform],
    (packages, profile): (&[&str], Profile),
    libc: Libc,
    env: &[(&str, &Path)],
) -> Result<Vec<Vec<PathBuf>>> {
    let mut cargo = system::cargo();
    cargo
        .current_dir(crate::workspace_root())
        .args(["build", "--profile", profile.name()]);
    for package in packages {
        cargo.args(["-p", package, "--bin", package]);
    }
    cargo
        // The image strips debug info anyway, and not making it is a good part of the build.
        .env("CARGO_PROFILE_RELEASE_DEBUG", "0")
        .envs(env.iter().copied());
    for platform in platforms {
        let triple = platform.triple(libc);
        add_rust_target(&triple)?;
        cargo.args(["--target", &triple]);
        if let Some((cc, debian_packages)) = platform.c_compiler(libc) {
            let debian_packages = debian_packages
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>();
            system::ensure_packages(
                &debian_packages,
                &format!("{} cannot be built for {triple}", packages.join(" and ")),
            )?;
            cargo.env(format!("CC_{}", triple.replace('-', "_")), &cc);
            let linker = match libc {
                Libc::Gnu => cc.as_str(),
                Libc::Musl => "rust-lld",
            };
            cargo.env(cargo_target_env(&triple, "LINKER"), linker);
        }
    }
    system::run(&mut cargo)?;
    let target_dir = crate::target_dir()?;
    Ok(platforms
        .iter()
        .map(|platform| {
            let dir = target_dir.join(platform.triple(libc)).join(profile.name());
            packages.iter().map(|package| dir.join(package)).collect()
        })
        .collect())
}

/// `CARGO_TARGET_<TRIPLE>_<key>`.
fn cargo_target_env(triple: &str, key: &str) -> String {
    format!(
        "CARGO_TARGET_{}_{key}",
        triple.to_uppercase().replace('-', "_")
    )
}

fn add_rust_target(triple: &str) -> Result<()> {
    system::run(Command::new("rustup").args(["target", "add", triple]))
        .with_context(|| format!("adding the Rust target {triple}"))
}

fn file_name(path: &Path) -> Result<String> {
    path.file_name()
        .and_then(|name| name.to_str())
        .map(str::to_owned)
        .with_context(|| format!("{} has no file name", path.display()))
}

/// Builds weir-agent, weir-cni and kubectl-weir with `profile` for every platform and writes the image
/// archive, `<target dir>/image/weir-agent.tar`; returns its path.
///
/// `native_agent`: this machine's weir-agent, built already (`cargo xtask test` builds the
/// workspace's binaries for the tests first): taken as it is rather than built again for the
/// image, one build of the agent's crates less. That one has the test harness's fault-injection
/// points compiled in (cargo unifies features), inert unless a process sets them up, which only
/// weir-agent-with-failpoints does; so it is for the tests' image, never a release.
pub fn build(object: &Path, profile: Profile, native_agent: Option<&Path>) -> Result<PathBuf> {
    // This machine's first: docker-archive's manifest names one image, the one that runs here.
    let mut platforms = PLATFORMS.to_vec();
    platforms.sort_by_key(|platform| !platform.is_native());
    let names = |platforms: &[Platform]| {
        platforms
            .iter()
            .map(|p| p.oci)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let name = profile.name();
    let prebuilt = native_agent.filter(|_| platforms[0].is_native());
    let to_build = &platforms[usize::from(prebuilt.is_some())..];
    if let Some(agent) = prebuilt {
        step(&format!(
            "taking {} for {}",
            agent.display(),
            platforms[0].oci
        ));
    }
    step(&format!(
        "building {AGENT} ({name}) for {}",
        names(to_build)
    ));
    // Only this package: built with the test harness, weir-agent would get its fault-injection
    // points (cargo unifies features).
    let built = build_for_platforms(
        to_build,
        (&[AGENT], profile),
        Libc::Gnu,
        &[("WEIR_EBPF_OBJECT", object)],
    )?;
    let agents: Vec<PathBuf> = prebuilt
        .map(Path::to_path_buf)
        .into_iter()
        .chain(built.into_iter().flatten())
        .collect();
    let names = names(&platforms);
    step(&format!(
        "building {PLUGIN} and {KUBECTL_PLUGIN} ({name}, static with musl) for {names}"
    ));
    let static_binaries = [PLUGIN, KUBECTL_PLUGIN];
    let statics = build_for_platforms(&platforms, (&static_binaries, profile), Libc::Musl, &[])?;
    let mut images = Vec::new();
    for ((platform, agent), statics) in platforms.iter().zip(&agents).zip(&statics) {
        let mut binaries = vec![(AGENT, agent.as_path())];
        binaries.extend(
            static_binaries
                .into_iter()
                .zip(statics.iter().map(PathBuf::as_path)),
        );
        images.push(PlatformImage::new(
            &platform.files(&binaries)?,
            platform.oci,
        )?);
    }
    let target = crate::target_dir()?;
    step(&format!("writing the image {}", reference()));
    let archive = target.join("image").join("weir-agent.tar");
    let partial = archive.with_extension("tar.partial");
    Image::new(images, &reference())?
        .write(std::io::BufWriter::new(fs::File::create(&partial)?))
        .with_context(|| format!("writing {}", partial.display()))?;
    fs::rename(&partial, &archive)?;
    Ok(archive)
}

/// What the dynamic loader reads of an ELF file (of any architecture): the loader it names
/// (`PT_INTERP`; none for a static binary) and the libraries it names (`DT_NEEDED`).
#[derive(Debug)]
struct DynamicLinking {
    interpreter: Option<PathBuf>,
    needed: Vec<String>,
}

impl DynamicLinking {
    fn of(file: &Path) -> Result<Self> {
        let data = fs::read(file).with_context(|| format!("reading {}", file.display()))?;
        let parsed = match object::FileKind::parse(&*data) {
            Ok(object::FileKind::Elf64) => Self::parse::<elf::FileHeader64<Endianness>>(&data),
            Ok(object::FileKind::Elf32) => Self::parse::<elf::FileHeader32<Endianness>>(&data),
            Ok(kind) => bail!("{kind:?} is no ELF file"),
            Err(error) => Err(error.into()),
        };
        parsed.with_context(|| format!("reading the ELF headers of {}", file.display()))
    }

    fn parse<Elf: FileHeader<Endian = Endianness>>(data: &[u8]) -> Result<Self> {
        let header = Elf::parse(data)?;
        let endian = header.endian()?;
        let mut interpreter = None;
        for segment in header.program_headers(endian, data)? {
            if let Some(path) = segment.interpreter(endian, data)? {
                interpreter = Some(PathBuf::from(OsStr::from_bytes(path)));
            }
        }
        let dynamic = header.sections(endian, data)?.dynamic_table(endian, data)?;
        let needed = dynamic
            .iter()
            .filter(|entry| entry.tag == elf::DT_NEEDED)
            .map(|entry| {
                let name = dynamic.string(entry)?;
                String::from_utf8(name.to_vec()).context("a library name that is not UTF-8")
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            interpreter,
            needed,
        })
    }
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

    /// `value` as JSON, through serde_json's `Value`, whose objects keep their keys sorted:
    /// oci-spec keeps annotations in a `HashMap`, and the same image must make the same bytes.
    fn of_json(value: &impl Serialize) -> Result<Self> {
        Ok(Self::new(json_bytes(value)?))
    }

    /// Its path in the archive, under `blobs/`.
    fn path(&self) -> String {
        format!("blobs/{}", self.digest.replacen(':', "/", 1))
    }

    /// An OCI descriptor of it.
    fn descriptor(&self, media_type: MediaType) -> Result<Descriptor> {
        Ok(DescriptorBuilder::default()
            .media_type(media_type)
            .digest(Digest::from_str(&self.digest)?)
            .size(u64::try_from(self.bytes.len())?)
            .build()?)
    }
}

/// `value` as JSON, with every object's keys sorted (see [`Blob::of_json`]).
fn json_bytes(value: &impl Serialize) -> Result<Vec<u8>> {
    Ok(serde_json::to_vec(&serde_json::to_value(value)?)?)
}

fn sha256(bytes: &[u8]) -> String {
    let hash = Sha256::digest(bytes);
    let hex: String = hash.iter().map(|byte| format!("{byte:02x}")).collect();
    format!("sha256:{hex}")
}

/// One platform's image: its layer, configuration and manifest.
struct PlatformImage {
    architecture: &'static str,
    layer: Blob,
    config: Blob,
    manifest: Blob,
}

impl PlatformImage {
    /// The image of `files` (path in the image → file on this machine) for `architecture`.
    fn new(files: &BTreeMap<String, PathBuf>, architecture: &'static str) -> Result<Self> {
        let layer_tar = layer_tar(files)?;
        let diff_id = sha256(&layer_tar);
        let mut gzip = GzEncoder::new(Vec::new(), Compression::best());
        gzip.write_all(&layer_tar)?;
        let layer = Blob::new(gzip.finish()?);
        let config = Blob::of_json(
            &ImageConfigurationBuilder::default()
                .architecture(Arch::from(architecture))
                .os(Os::Linux)
                .created(EPOCH)
                .config(
                    ConfigBuilder::default()
                        .entrypoint(vec![ENTRYPOINT.to_owned()])
                        .cmd(vec!["run".to_owned()])
                        .build()?,
                )
                .rootfs(RootFsBuilder::default().diff_ids(vec![diff_id]).build()?)
                .history(vec![HistoryBuilder::default()
                    .created(EPOCH)
                    .created_by("cargo xtask image")
                    .build()?])
                .build()?,
        )?;
        let manifest = Blob::of_json(
            &ImageManifestBuilder::default()
                .schema_version(SCHEMA_VERSION)
                .media_type(MediaType::ImageManifest)
                .config(config.descriptor(MediaType::ImageConfig)?)
                .layers(vec![layer.descriptor(MediaType::ImageLayerGzip)?])
                .build()?,
        )?;
        Ok(Self {
            architecture,
            layer,
            config,
            manifest,
        })
    }
}

/// The multi-platform image: each platform's, under one image index, which the name points to.
struct Image {
    reference: String,
    /// This machine's first.
    platforms: Vec<PlatformImage>,
    index: Blob,
}

impl Image {
    fn new(platforms: Vec<PlatformImage>, reference: &str) -> Result<Self> {
        let manifests = platforms
            .iter()
            .map(|image| {
                let mut descriptor = image.manifest.descriptor(MediaType::ImageManifest)?;
                descriptor.set_platform(Some(
                    PlatformBuilder::default()
                        .architecture(Arch::from(image.architecture))
                        .os(Os::Linux)
                        .build()?,
                ));
                Ok(descriptor)
            })
            .collect::<Result<Vec<_>>>()?;
        let index = Blob::of_json(&image_index(manifests)?)?;
        Ok(Self {
            reference: reference.to_owned(),
            platforms,
            index,
        })
    }

    /// The archive: the OCI layout's `oci-layout` and `index.json` (naming the image index),
    /// docker-archive's `manifest.json` and `repositories` (naming the first platform's image:
    /// docker-archive has no index), and the blobs they point to.
    fn write(&self, out: impl Write) -> Result<()> {
        let (repository, tag) = self
            .reference
            .rsplit_once(':')
            .context("the image reference has no tag")?;
        let mut index_descriptor = self.index.descriptor(MediaType::ImageIndex)?;
        // containerd names the image by the first, podman by the second; both the full name.
        index_descriptor.set_annotations(Some(HashMap::from([
            (
                "io.containerd.image.name".to_owned(),
                self.reference.clone(),
            ),
            (
                "org.opencontainers.image.ref.name".to_owned(),
                self.reference.clone(),
            ),
        ])));
        let layout_index = image_index(vec![index_descriptor])?;
        let first = self.platforms.first().context("an image of no platform")?;
        let docker_manifest = json!([{
            "Config": first.config.path(),
            "RepoTags": [self.reference],
            "Layers": [first.layer.path()],
        }]);
        // The legacy name → top layer map, as Docker still writes it.
        let layer_hex = first.layer.digest.trim_start_matches("sha256:");
        let repositories = json!({repository: {tag: layer_hex}});

        let mut archive = tar::Builder::new(out);
        for dir in ["blobs/", "blobs/sha256/"] {
            append(&mut archive, dir, None)?;
        }
        let blobs = self
            .platforms
            .iter()
            .flat_map(|image| [&image.layer, &image.config, &image.manifest])
            .chain([&self.index]);
        for blob in blobs {
            append(&mut archive, &blob.path(), Some((0o644, &blob.bytes)))?;
        }
        let oci_layout = OciLayoutBuilder::default()
            .image_layout_version("1.0.0")
            .build()?;
        for (path, bytes) in [
            ("oci-layout", json_bytes(&oci_layout)?),
            ("index.json", json_bytes(&layout_index)?),
            // docker-archive's files have no types in oci-spec.
            ("manifest.json", json_bytes(&docker_manifest)?),
            ("repositories", json_bytes(&repositories)?),
        ] {
            append(&mut archive, path, Some((0o644, &bytes)))?;
        }
        archive.into_inner()?.flush()?;
        Ok(())
    }
}

/// An OCI image index of `manifests`.
fn image_index(manifests: Vec<Descriptor>) -> Result<ImageIndex> {
    Ok(ImageIndexBuilder::default()
        .schema_version(SCHEMA_VERSION)
        .media_type(MediaType::ImageIndex)
        .manifests(manifests)
        .build()?)
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
    use serde_json::Value;

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

    /// The image of a fake agent and libc, for amd64 and arm64.
    fn test_image() -> Vec<u8> {
        let dir = tempfile::tempdir().unwrap();
        let file = |name: &str, content: &[u8], mode: u32| {
            let path = dir.path().join(name);
            fs::write(&path, content).unwrap();
            fs::set_permissions(&path, fs::Permissions::from_mode(mode)).unwrap();
            path
        };
        let platform = |architecture, multiarch: &str| {
            let files = BTreeMap::from([
                (
                    "usr/local/bin/weir-agent".to_owned(),
                    file(&format!("agent-{architecture}"), b"agent", 0o755),
                ),
                (
                    format!("lib/{multiarch}/libc.so.6"),
                    file(&format!("libc-{architecture}"), b"libc", 0o644),
                ),
            ]);
            PlatformImage::new(&files, architecture).unwrap()
        };
        let images = vec![
            platform("amd64", "x86_64-linux-gnu"),
            platform("arm64", "aarch64-linux-gnu"),
        ];
        let mut archive = Vec::new();
        Image::new(images, "localhost/weir-agent:1.2.3")
            .unwrap()
            .write(&mut archive)
            .unwrap();
        archive
    }

    /// The image index the archive's `index.json` names, and each platform's manifest.
    fn manifests(entries: &BTreeMap<String, (tar::Header, Vec<u8>)>) -> BTreeMap<String, Value> {
        let layout = json_at(entries, "index.json");
        let descriptors = layout["manifests"].as_array().unwrap();
        assert_eq!(descriptors.len(), 1);
        assert_eq!(
            descriptors[0]["mediaType"],
            "application/vnd.oci.image.index.v1+json"
        );
        let index: Value = serde_json::from_slice(blob(entries, &descriptors[0])).unwrap();
        index["manifests"]
            .as_array()
            .unwrap()
            .iter()
            .map(|descriptor| {
                assert_eq!(descriptor["platform"]["os"], "linux");
                let architecture = descriptor["platform"]["architecture"].as_str().unwrap();
                let manifest = serde_json::from_slice(blob(entries, descriptor)).unwrap();
                (architecture.to_owned(), manifest)
            })
            .collect()
    }

    #[test]
    fn the_oci_layout_indexes_every_platform_and_the_docker_archive_names_the_first() {
        let archive = test_image();
        let entries = entries(&archive);
        assert_eq!(
            json_at(&entries, "oci-layout"),
            json!({"imageLayoutVersion": "1.0.0"})
        );
        let annotations = &json_at(&entries, "index.json")["manifests"][0]["annotations"];
        assert_eq!(
            annotations["io.containerd.image.name"],
            "localhost/weir-agent:1.2.3"
        );
        assert_eq!(
            annotations["org.opencontainers.image.ref.name"],
            "localhost/weir-agent:1.2.3"
        );
        let manifests = manifests(&entries);
        assert_eq!(
            manifests.keys().collect::<Vec<_>>(),
            ["amd64", "arm64"],
            "a multi-platform index"
        );
        for (architecture, manifest) in &manifests {
            assert_eq!(
                manifest["mediaType"],
                "application/vnd.oci.image.manifest.v1+json"
            );
            let config: Value =
                serde_json::from_slice(blob(&entries, &manifest["config"])).unwrap();
            let layers = manifest["layers"].as_array().unwrap();
            assert_eq!(layers.len(), 1);
            // The layer's diff_id is the digest of the uncompressed tar.
            let mut layer_tar = Vec::new();
            GzDecoder::new(blob(&entries, &layers[0]))
                .read_to_end(&mut layer_tar)
                .unwrap();
            assert_eq!(config["rootfs"]["diff_ids"], json!([sha256(&layer_tar)]));
            assert_eq!(
                config["config"]["Entrypoint"],
                json!(["/usr/local/bin/weir-agent"])
            );
            assert_eq!(&config["architecture"], architecture);
        }

        let first = &manifests["amd64"];
        let docker = json_at(&entries, "manifest.json");
        let path = |descriptor: &Value| {
            format!("blobs/{}", descriptor["digest"].as_str().unwrap()).replacen(':', "/", 1)
        };
        assert_eq!(docker[0]["Config"], path(&first["config"]));
        assert_eq!(docker[0]["Layers"], json!([path(&first["layers"][0])]));
        assert_eq!(docker[0]["RepoTags"], json!(["localhost/weir-agent:1.2.3"]));
        let layer_hex = first["layers"][0]["digest"]
            .as_str()
            .unwrap()
            .replace("sha256:", "");
        assert_eq!(
            json_at(&entries, "repositories"),
            json!({"localhost/weir-agent": {"1.2.3": layer_hex}})
        );
    }

    #[test]
    fn the_layer_holds_the_files_and_their_directories_owned_by_root_at_the_epoch() {
        let archive = test_image();
        let entries = entries(&archive);
        let manifest = &manifests(&entries)["arm64"];
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
            ("lib/aarch64-linux-gnu/", 0o755, ""),
            ("lib/aarch64-linux-gnu/libc.so.6", 0o644, "libc"),
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
    fn the_loader_and_the_needed_libraries_are_read_from_the_elf_headers() {
        // This test's own executable: built for this machine's glibc, dynamically.
        let linking = DynamicLinking::of(&std::env::current_exe().unwrap()).unwrap();
        let interpreter = linking
            .interpreter
            .expect("a dynamic executable names its loader");
        assert!(
            interpreter.is_absolute() && interpreter.exists(),
            "{interpreter:?}"
        );
        assert!(
            linking.needed.iter().any(|library| library == "libc.so.6"),
            "{:?}",
            linking.needed
        );
        let libc = DynamicLinking::of(Path::new("/lib/x86_64-linux-gnu/libc.so.6"))
            .or_else(|_| DynamicLinking::of(Path::new("/lib/aarch64-linux-gnu/libc.so.6")))
            .unwrap();
        assert!(libc.needed.iter().all(|library| library != "libc.so.6"));

        let error = DynamicLinking::of(Path::new(env!("CARGO_MANIFEST_PATH"))).unwrap_err();
        assert!(format!("{error:#}").contains("Cargo.toml"), "{error:#}");
    }
}
