//! `kubectl exec` into weir's pod: kubectl speaks the exec protocol, authenticates as the user
//! does, and passes the command's output and exit status on.
use std::{
    io,
    os::unix::process::ExitStatusExt,
    path::{Path, PathBuf},
    process::{Command, ExitCode, ExitStatus},
};

use anyhow::{Context, Result};

/// The container of weir's pod that has weir-agent.
const CONTAINER: &str = "weir-agent";

/// kubectl, told the kubeconfig and context the plugin was given (it reads $KUBECONFIG itself).
pub struct Kubectl {
    pub kubeconfig: Option<PathBuf>,
    pub context: Option<String>,
}

impl Kubectl {
    /// `weir-agent <args> <agent_args>` in `namespace/pod`, with this process's stdin, stdout and
    /// stderr.
    pub fn exec(
        &self,
        namespace: &str,
        pod: &str,
        args: &[String],
        agent_args: &[String],
    ) -> Result<ExitStatus> {
        self.command(namespace, pod, args, agent_args)
            .status()
            .map_err(not_started)
    }

    /// [`Kubectl::exec`] with stdout saved to `output`, which appears only once the command has
    /// succeeded, whole; it is never written over.
    pub fn exec_to_file(
        &self,
        namespace: &str,
        pod: &str,
        args: &[String],
        agent_args: &[String],
        output: &Path,
    ) -> Result<ExitStatus> {
        let dir = match output.parent() {
            Some(dir) if !dir.as_os_str().is_empty() => dir,
            _ => Path::new("."),
        };
        let partial = tempfile::Builder::new()
            .prefix(".weir-bug-report-")
            .tempfile_in(dir)
            .with_context(|| format!("creating a file in {}", dir.display()))?;
        let status = self
            .command(namespace, pod, args, agent_args)
            .stdout(partial.as_file().try_clone()?)
            .status()
            .map_err(not_started)?;
        if status.success() {
            partial
                .persist_noclobber(output)
                .map_err(|error| error.error)
                .with_context(|| format!("saving {}", output.display()))?;
        }
        Ok(status)
    }

    fn command(
        &self,
        namespace: &str,
        pod: &str,
        args: &[String],
        agent_args: &[String],
    ) -> Command {
        let mut command = Command::new("kubectl");
        if let Some(kubeconfig) = &self.kubeconfig {
            command.arg("--kubeconfig").arg(kubeconfig);
        }
        if let Some(context) = &self.context {
            command.args(["--context", context]);
        }
        command
            .args([
                "exec",
                "-n",
                namespace,
                pod,
                "-c",
                CONTAINER,
                "--",
                "weir-agent",
            ])
            .args(args)
            .args(agent_args);
        command
    }
}

fn not_started(error: io::Error) -> anyhow::Error {
    let what = match error.kind() {
        io::ErrorKind::NotFound => {
            "kubectl is not on PATH: kubectl weir runs weir-agent with kubectl exec"
        }
        _ => "running kubectl",
    };
    anyhow::Error::new(error).context(what)
}

/// kubectl's exit status as the plugin's: its code, or 128 + the signal that ended it, as a
/// shell reports it.
pub fn exit_code(status: ExitStatus) -> ExitCode {
    let code = status
        .code()
        .or_else(|| status.signal().map(|signal| 128 + signal))
        .unwrap_or(1);
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}
