//! The command line: what users type.
//!
//! Every subcommand enum is `defer`red: clap builds a subcommand's
//! arguments only when that subcommand is parsed or its help shown, so
//! `cairn run` does not build the whole tree first (a third of a megabyte
//! of allocations, on every command). A deferred item's own doc comment
//! would then override the help of the command it is used in, so doc
//! comments go on variants and fields only; a test holds that.

use std::path::PathBuf;

use cairn_sandbox::limits::{CpuCount, DiskSize, MemorySize, PidCount};
use clap::{Args, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "cairn",
    version,
    about = "Durable, forkable sandboxes for AI agents and long-running pipelines",
    long_about = "Durable, forkable sandboxes for AI agents and long-running pipelines.\n\n\
        Sandboxes are Linux namespaces, cgroups, seccomp and an overlay root; they outlive \
        the command that made them. State lives in $CAIRN_HOME (default ~/.local/share/cairn). \
        Ids go to stdout, one per line; progress and errors go to stderr.",
    after_help = "Examples:\n  cairn run -- echo hello\n  id=$(cairn create --memory 512M)\n  cairn exec $id -- sh -c 'uname -n; ls /'\n  cairn cp ./data.csv $id:/tmp/\n  cairn rm -f $id"
)]
pub struct Cli {
    /// State directory (default: $CAIRN_HOME, else ~/.local/share/cairn).
    #[arg(long, global = true, value_name = "DIR")]
    pub home: Option<PathBuf>,
    /// Where the state store is: postgres://USER@HOST:PORT/DATABASE (or
    /// postgresql://) for PostgreSQL, one database per state directory;
    /// sqlite:PATH, or unset, for the embedded SQLite store
    /// (the state directory's state.db).
    #[arg(long, global = true, value_name = "URL", env = "CAIRN_STATE", hide_env_values = true)]
    pub state: Option<String>,
    /// An S3-compatible store for snapshots' chunks,
    /// s3://BUCKET/PREFIX?endpoint=http://HOST:PORT&region=REGION
    /// (credentials from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY); the
    /// state directory's store is then its cache. Unset: local only.
    #[arg(long, global = true, value_name = "URL", env = "CAIRN_STORE")]
    pub store: Option<String>,
    /// Act as the holder of this API token (`cairn token create`; better
    /// given as CAIRN_TOKEN, which `ps` does not show). A tenant's token
    /// sees and acts on that tenant's sandboxes, snapshots, sessions, runs,
    /// artifacts and images only (the administrator's images too, to use),
    /// within the tenant's limits, and is refused the administrator's
    /// commands (tenant, token, gc, verify, serve, worker, agent, bench).
    /// Each command made with a token is in `cairn token log` (each tool
    /// call of `cairn mcp`).
    /// Unset: the administrator.
    #[arg(
        long,
        global = true,
        value_name = "TOKEN",
        env = "CAIRN_TOKEN",
        hide_env_values = true
    )]
    pub token: Option<String>,
    /// Show debug logs on stderr.
    #[arg(long, short, global = true)]
    pub verbose: bool,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Args, Clone)]
pub struct SandboxArgs {
    /// Image to start from (`cairn image ls`); the default is built on first use.
    #[arg(long, default_value = "busybox")]
    pub image: String,
    #[command(flatten)]
    pub limits: LimitArgs,
    /// A command to keep running in the background (repeatable); it is
    /// started again after every restore, fork and reset, e.g.
    /// --service 'python3 -m http.server'.
    #[arg(long = "service", value_name = "CMD")]
    pub services: Vec<String>,
    /// `native` (namespaces; snapshots keep files) or `gvisor` (runsc;
    /// snapshots keep memory and running processes too).
    #[arg(long, default_value = "native", value_parser = ["native", "gvisor"])]
    pub driver: String,
}

#[derive(Args, Clone)]
pub struct LimitArgs {
    /// Sandbox name, also its host name (letters, digits, '-').
    #[arg(long)]
    pub name: Option<String>,
    /// Memory limit, e.g. 512M or 2G (default 1G); exceeding it OOM-kills.
    #[arg(long, value_name = "SIZE")]
    pub memory: Option<MemorySize>,
    /// CPU limit in cores, fractions allowed (default: all cores).
    #[arg(long, value_name = "N")]
    pub cpus: Option<CpuCount>,
    /// Limit on processes and threads (default 1024); stops fork bombs.
    #[arg(long, value_name = "N")]
    pub pids: Option<PidCount>,
    /// Disk limit, e.g. 1G or 10G (at least 16M): the sandbox's files go on
    /// a file system of this size (an ext4 image, its metadata included),
    /// and a write past it fails with "No space left on device". Default:
    /// CAIRN_DISK, else none (the state directory's file system). A fork
    /// keeps its sandbox's.
    #[arg(long, value_name = "SIZE")]
    pub disk: Option<DiskSize>,
    #[command(flatten)]
    pub network: NetworkArgs,
}

#[derive(Args, Clone, Default)]
pub struct NetworkArgs {
    /// `none`: loopback only (the default; a fork of a sandbox keeps the
    /// sandbox's). `egress`: an address of its own, NAT to this host's
    /// route out, DNS through this host's resolver; link-local, private
    /// and this host's addresses stay refused. See docs/network.md.
    #[arg(long, value_name = "MODE", value_parser = ["none", "egress"])]
    pub network: Option<String>,
    /// Reach only these (repeatable; implies egress): HOST[:PORT] (pinned
    /// to the addresses it resolves to at start), ADDRESS[:PORT] or
    /// ADDRESS/LEN[:PORT]. Everything else is refused, DNS included.
    #[arg(long = "allow", value_name = "DEST")]
    pub allow: Vec<String>,
    /// Make the sandbox's TCP PORT reachable at this host's HOSTPORT, on
    /// every host address or on ADDR alone (repeatable; implies egress),
    /// e.g. --publish 8080:8000 or --publish 127.0.0.1:8080:8000. The host
    /// port is held while published: one in use is refused.
    #[arg(long = "publish", short = 'p', value_name = "[ADDR:]HOSTPORT:PORT")]
    pub publish: Vec<String>,
}

impl NetworkArgs {
    /// The policy `--network`, `--allow` and `--publish` give; nothing
    /// given is `None` (a fork keeps its source's).
    pub fn policy(&self) -> anyhow::Result<Option<cairn_sandbox::net::NetPolicy>> {
        if self.network.is_none() && self.allow.is_empty() && self.publish.is_empty() {
            return Ok(None);
        }
        Ok(Some(cairn_sandbox::net::NetPolicy::parse(
            self.network.as_deref(),
            &self.allow,
            &self.publish,
        )?))
    }
}

#[derive(Args, Clone)]
pub struct ProcessArgs {
    /// Set an environment variable (repeatable).
    #[arg(long = "env", short = 'e', value_name = "KEY=VALUE")]
    pub env: Vec<String>,
    /// Working directory inside the sandbox (default /).
    #[arg(long = "workdir", short = 'w', value_name = "DIR")]
    pub workdir: Option<String>,
    /// Run as this user of the sandbox: a name from its /etc/passwd or
    /// UID[:GID] (default root, or the USER of an image built from a
    /// Dockerfile).
    #[arg(long, short = 'u', value_name = "USER")]
    pub user: Option<String>,
    /// Forward this terminal's stdin to the process.
    #[arg(long, short = 'i')]
    pub interactive: bool,
    /// Kill the process after this many seconds (exit status 124).
    #[arg(long, value_name = "SECS")]
    pub timeout: Option<f64>,
}

#[derive(Subcommand)]
#[command(defer = true)]
pub enum Command {
    /// Run a command in a fresh sandbox, stream its output, remove the sandbox.
    ///
    /// Exits with the command's status (128+N when killed by signal N, 127
    /// when the command does not exist). Pipeline runs are `cairn pipeline
    /// show|ls|approve|reject`.
    #[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
    Run {
        /// Boxed: the largest variant by far.
        #[command(flatten)]
        sandbox: Box<SandboxArgs>,
        #[command(flatten)]
        process: ProcessArgs,
        /// The command and its arguments.
        #[arg(last = true, required = true, value_name = "CMD")]
        cmd: Vec<String>,
        #[command(subcommand)]
        show: Option<RunCommand>,
    },
    /// Pipelines and their runs: stages in sandboxes forked from snapshots.
    #[command(subcommand)]
    Pipeline(PipelineCommand),
    /// Where a pipeline run's time and bytes went, stage by stage, with
    /// advice on snapshots and checkpoints where it applies.
    ///
    /// For each stage (each branch of a group): setup time (making the
    /// sandbox, writing edits) against compute time (its commands), the
    /// output snapshot's and checkpoints' cost and new bytes, artifacts,
    /// retries with the work they lost and what restoring a checkpoint
    /// saved. Advice is given for a stage computing over 5 minutes without
    /// `checkpoint_every`, for over 10 GiB carried as artifacts, and for
    /// commands every branch of a group runs alike that a stage before the
    /// group would run once.
    #[command(after_help = "Examples:\n  cairn audit 3f2a9c\n  cairn audit 3f2a9c --json | jq '.recommendations'")]
    Audit {
        /// Run id or unique prefix (`cairn pipeline ls`).
        run: String,
        /// Print JSON for scripts instead of text.
        #[arg(long)]
        json: bool,
        /// Compute time worth a snapshot (seconds; default 300).
        #[arg(long, hide = true, value_name = "SECS", default_value_t = 300.0)]
        long_stage_secs: f64,
        /// State too large for artifacts (default 10G).
        #[arg(long, hide = true, value_name = "SIZE", default_value = "10G", value_parser = parse_bytes)]
        large_state: u64,
    },
    /// Claim and run pipeline stages from the shared stage queue.
    ///
    /// Many hosts share one queue through one PostgreSQL state store
    /// (--state postgres://…) and one remote chunk store (--store s3://…):
    /// `cairn pipeline run --queue` on any of them enqueues, and each
    /// worker claims runs and branches with a lease it renews. A worker that
    /// dies or stalls past its lease loses its jobs to another worker, which
    /// resumes each stage from its newest checkpoint; the stalled one's
    /// results are refused when it wakes (a fencing token). SIGTERM or
    /// Ctrl-C stops claiming and waits for the jobs running; a second one
    /// exits at once (their leases then expire and other workers take them).
    #[command(args_conflicts_with_subcommands = true)]
    Worker {
        #[command(flatten)]
        opts: WorkerArgs,
        #[command(subcommand)]
        list: Option<WorkerCommand>,
    },
    /// Deprecated: `cairn pipeline ls`.
    #[command(hide = true)]
    Runs {
        /// Print JSON for scripts instead of text.
        #[arg(long)]
        json: bool,
    },
    /// The dead-letter queue: stages whose retries ran out.
    #[command(subcommand)]
    Dlq(DlqCommand),
    /// Agent sessions: a context log beside a sandbox's snapshots, with
    /// suspend and resume, fork, rewind and a verifiable hash chain
    /// (docs/sessions.md).
    #[command(subcommand)]
    Session(SessionCommand),
    /// Pipeline artifacts (files collected from stages into the store).
    #[command(subcommand)]
    Artifact(ArtifactCommand),
    /// Create a sandbox that keeps running; prints its id.
    Create {
        #[command(flatten)]
        sandbox: SandboxArgs,
    },
    /// Run a command in a running sandbox.
    ///
    /// Exits with the command's status, like `run`. With -d the command
    /// runs in the background (its output goes to `cairn logs`) and its pid
    /// is printed. With -t it runs on a terminal of its own in the sandbox
    /// (`cairn exec -t ID -- sh` for a shell): this terminal's keys go to
    /// it as typed (Ctrl-C included), its size follows this window's, and
    /// closing this terminal hangs it up.
    Exec {
        /// Sandbox id, unique id prefix or name.
        sandbox: String,
        /// Start in the background and return at once.
        #[arg(long, short = 'd')]
        detach: bool,
        /// Run on a new terminal in the sandbox, with this one's size and
        /// input (implies -i; its output is all on stdout).
        #[arg(long, short = 't', conflicts_with = "detach")]
        tty: bool,
        #[command(flatten)]
        process: ProcessArgs,
        /// The command and its arguments.
        #[arg(last = true, required = true, value_name = "CMD")]
        cmd: Vec<String>,
    },
    /// Copy a file into or out of a sandbox; one side is ID:/path.
    ///
    /// `cairn cp ./in.txt ID:/tmp/` copies in; `cairn cp ID:/tmp/out.txt .`
    /// copies out; `-` as the destination writes to stdout. Modification
    /// times and permission bits are kept; a file copied out gets its
    /// permission bits less the umask, never setuid, setgid or sticky. A
    /// destination that is a symlink is replaced by the copy, not written
    /// through (one to a directory gets the file inside).
    Cp {
        /// A host path, or ID:/path in a sandbox.
        src: String,
        /// A host path (`-`: stdout), or ID:/path in a sandbox.
        dst: String,
    },
    /// List sandboxes.
    Ps {
        /// Only print ids.
        #[arg(long, short)]
        quiet: bool,
        /// Print JSON for scripts instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Print a sandbox's log (init's messages, background processes'
    /// output), or with a stage, a pipeline stage's output: `cairn logs RUN STAGE`.
    Logs {
        /// Sandbox id, unique id prefix or name; with STAGE, a run id or prefix.
        sandbox: String,
        /// A stage of the run given first (`stage` or `stage.branch`).
        stage: Option<String>,
        /// Only the last N lines.
        #[arg(long, value_name = "N")]
        tail: Option<usize>,
    },
    /// Remove sandboxes: processes, cgroups, files. Running ones need -f.
    Rm {
        /// Kill running sandboxes first.
        #[arg(long, short)]
        force: bool,
        /// Sandbox ids, unique id prefixes or names.
        #[arg(required = true)]
        sandboxes: Vec<String>,
    },
    /// Snapshot a sandbox's files; prints the snapshot id.
    ///
    /// A running sandbox is frozen while its changes since its last snapshot
    /// are captured, then keeps running. `cairn snapshot rm SNAPSHOT...`
    /// forgets snapshots (`cairn gc` then reclaims their storage).
    #[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
    Snapshot {
        /// Sandbox id, unique id prefix or name.
        #[arg(required = true)]
        sandbox: Option<String>,
        /// A label to find the snapshot by (`cairn restore LABEL`).
        #[arg(long)]
        label: Option<String>,
        /// Print JSON for scripts instead of text.
        #[arg(long)]
        json: bool,
        #[command(subcommand)]
        command: Option<SnapshotCommand>,
    },
    /// List snapshots with their lineage, sizes and labels (and, with a
    /// remote store, whether each is durable there).
    Snapshots {
        /// Draw the lineage as a tree.
        #[arg(long)]
        tree: bool,
        /// Print JSON for scripts instead of text.
        #[arg(long)]
        json: bool,
    },
    /// What differs between two snapshots, sandboxes or a run's stages and
    /// branches: files added, removed and changed, with a unified diff for
    /// text files.
    ///
    /// Each side is a snapshot (id, prefix or label), a sandbox (id, prefix
    /// or name: its files as they are now, read while it runs), or a run's
    /// stage or branch output, RUN/STAGE or RUN/STAGE.BRANCH. Computed from
    /// layer indexes: layers both sides share are not compared, and a file's
    /// content is compared by its chunks' hashes, so only text files under
    /// --text-max are read. A modification time alone is not a change.
    /// Exit status: 0 when nothing differs, 1 when something does.
    #[command(after_help = "Examples:\n  cairn diff base-label my-sandbox\n  \
                            cairn diff RUN/align.fast RUN/align.exact --json\n  \
                            cairn diff SNAP_A SNAP_B --stat")]
    Diff {
        /// The side compared from.
        a: String,
        /// The side compared to.
        b: String,
        /// Only the list of paths and what changed, no unified diffs.
        #[arg(long)]
        stat: bool,
        /// Unified diffs for text files of at most this size on each side.
        #[arg(long, value_name = "SIZE", default_value = "256K", value_parser = parse_bytes)]
        text_max: u64,
        /// List at most this many changes (the counts cover all of them).
        #[arg(long, value_name = "N", default_value_t = 10_000)]
        max_changes: usize,
        /// Print JSON for scripts instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Check that snapshots are whole: every object each reaches, read back
    /// from every place it is stored and hashed again.
    ///
    /// A snapshot's id is the root of a hash tree over its manifest, its
    /// layers' indexes, every file chunk and its memory image, so this checks
    /// each snapshot against its id. Damaged objects are named with what
    /// they are (a file's path and offset, a memory image file, a layer's
    /// index). With a store in S3, both the bucket's copy and the cache's
    /// are checked, and --repair replaces a damaged copy with an intact one
    /// (a local store has one copy: damage there is reported, not mended).
    /// Exit status: 0 when every snapshot is whole, 1 when one is not.
    #[command(after_help = "Examples:\n  cairn verify --all\n  cairn verify my-label --repair --json")]
    Verify {
        /// Snapshots (id, prefix or label); none with --all.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        snapshots: Vec<String>,
        /// Every snapshot.
        #[arg(long)]
        all: bool,
        /// Replace damaged copies with intact ones (a store in S3).
        #[arg(long)]
        repair: bool,
        /// Print JSON for scripts instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Start N new sandboxes from a snapshot, or from a sandbox (snapshotted
    /// first); prints their ids.
    Fork {
        /// Sandbox (id, prefix, name) or snapshot (id, prefix, label).
        source: String,
        /// How many forks.
        #[arg(short = 'n', long = "count", default_value_t = 1)]
        count: usize,
        #[command(flatten)]
        limits: LimitArgs,
        /// Driver to restore with (default: the snapshot's).
        #[arg(long, value_parser = ["native", "gvisor"])]
        driver: Option<String>,
    },
    /// Start a new sandbox from a snapshot; prints its id.
    Restore {
        /// Snapshot id, unique prefix or label.
        snapshot: String,
        #[command(flatten)]
        limits: LimitArgs,
        /// Driver to restore with (default: the snapshot's).
        #[arg(long, value_parser = ["native", "gvisor"])]
        driver: Option<String>,
    },
    /// Rewind a sandbox to a snapshot in place (its processes restart).
    Reset {
        /// Sandbox id, unique id prefix or name.
        sandbox: String,
        /// Snapshot id, unique prefix or label.
        snapshot: String,
    },
    /// Release what crashed or killed Cairn processes left behind, and the
    /// layers and chunks nothing uses any more.
    Gc {
        /// Print JSON for scripts instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Build, import, list and remove images.
    #[command(subcommand)]
    Image(ImageCommand),
    /// Serve the HTTP API (docs/api.md) until SIGINT or SIGTERM.
    ///
    /// Listens on a Unix socket in the state directory (mode 0600; no token
    /// needed) and, with --listen, on TCP, where every request needs
    /// `Authorization: Bearer TOKEN` (`cairn token create`). The CLI keeps
    /// working beside it on the same state directory. Stopping the server
    /// lets requests in flight finish; sandboxes keep running, and runs it
    /// was executing are resumed by the next `cairn serve`.
    #[command(
        after_help = "Examples:\n  cairn serve\n  curl --unix-socket ~/.local/share/cairn/cairn.sock http://cairn/v1/sandboxes\n  cairn token create ci && cairn serve --listen 127.0.0.1:7070"
    )]
    Serve {
        /// The Unix socket (default: cairn.sock in the state directory).
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
        /// Listen on TCP too, e.g. 127.0.0.1:7070 (bearer tokens required).
        #[arg(long, value_name = "ADDR")]
        listen: Option<std::net::SocketAddr>,
        /// Serve the E2B-compatible API on this TCP address too (docs/e2b.md):
        /// point E2B_API_URL and E2B_SANDBOX_URL here, E2B_API_KEY = a token.
        #[arg(long, value_name = "ADDR")]
        e2b: Option<std::net::SocketAddr>,
        /// Which driver runs E2B sandboxes: native (the default; a pause
        /// keeps files, processes end) or gvisor (a pause keeps memory and
        /// running processes; needs runsc). TEMPLATE=DRIVER chooses for one
        /// template; repeat the flag, e.g. `--e2b-driver gvisor
        /// --e2b-driver debian=native`. A snapshot used as a template keeps
        /// the driver it was taken on.
        #[arg(long = "e2b-driver", value_name = "[TEMPLATE=]DRIVER", requires = "e2b",
              value_parser = cairn_api::e2b::parse_driver_choice)]
        e2b_driver: Vec<cairn_api::e2b::DriverChoice>,
        /// What E2B's `base` template is: debian (the default, as E2B's:
        /// Debian with bash, python3, pip, git and curl, commands as the
        /// user `user`; built from Debian's packages when missing, which
        /// takes minutes once: `cairn image build e2b-base` ahead) or
        /// busybox (Cairn's tiny default image, commands as root).
        #[arg(long = "e2b-base", value_name = "BASE", default_value = "debian", requires = "e2b",
              value_parser = ["debian", "busybox"])]
        e2b_base: String,
        /// The network of E2B sandboxes on native templates: none (the
        /// default: loopback only, whatever the SDK asks) or egress (a route
        /// out as `--network egress` gives, E2B's allow_out/deny_out rules
        /// and update_network honoured; needs root and nftables: `cairn
        /// doctor`). gVisor templates have no network either way.
        #[arg(long = "e2b-network", value_name = "MODE", default_value = "none", requires = "e2b",
              value_parser = ["none", "egress"])]
        e2b_network: String,
        /// The domain `get_host(port)` names a sandbox's ports under
        /// (`PORT-SANDBOXID.DOMAIN`): a wildcard DNS name pointing at this
        /// gateway (or a proxy in front of it); the gateway accepts those
        /// names. Without it the SDK uses its own (E2B_DOMAIN, else E2B's).
        #[arg(long = "e2b-domain", value_name = "DOMAIN", requires = "e2b", value_parser = parse_domain)]
        e2b_domain: Option<String>,
        /// How many paused gVisor sandboxes are kept ready to resume: after
        /// such a pause the sandbox its resume needs is made ahead and waits
        /// (runsc's processes, about 40 MB, no memory of the sandbox's), so
        /// `connect()` only loads the image (docs/gvisor.md, "Resuming
        /// into a sandbox prepared ahead"). Beyond N, for a tenant with
        /// limits and after a server restart, a resume makes its sandbox
        /// then. 0 turns it off.
        #[arg(long = "e2b-warm", value_name = "N", default_value_t = 8, requires = "e2b",
              value_parser = clap::value_parser!(u16).range(0..=1024))]
        e2b_warm: u16,
        /// How many suspended gVisor sessions are kept ready to resume:
        /// after a suspend through this server (or its idle timer) the
        /// sandbox the resume needs is made ahead and waits (runsc's
        /// processes, about 40 MB, none of the session's memory), so the
        /// resume only loads the image. Beyond N, for a tenant with limits,
        /// after a server restart and for sessions suspended by another
        /// command, a resume makes its sandbox then. 0 turns it off.
        #[arg(long = "session-warm", value_name = "N", default_value_t = 8,
              value_parser = clap::value_parser!(u16).range(0..=1024))]
        session_warm: u16,
        /// The largest file upload accepted (413 above it), e.g. 512M, 4G.
        #[arg(long, default_value = "1G", value_name = "SIZE", value_parser = parse_bytes)]
        max_upload: u64,
        /// Threads for file and control requests to sandboxes' init; as many
        /// may wait, one sandbox may hold a quarter, and beyond that a
        /// request is answered 503 (a sandbox whose init stalls cannot take
        /// the threads other requests need).
        #[arg(long, default_value_t = 256, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=4096))]
        init_threads: u16,
        /// Sandboxes running at once; creates, forks and restores past it
        /// wait in a queue (highest Priority header first, then the token
        /// holding fewest) until one goes or their Request-Timeout passes
        /// (then 429). Default: no count, only the memory and CPU budgets.
        #[arg(long, value_name = "N")]
        max_sandboxes: Option<u64>,
        /// The sum of running sandboxes' memory limits before requests queue,
        /// e.g. 64G. Default: four times the host's memory.
        #[arg(long, value_name = "SIZE", value_parser = parse_bytes)]
        max_memory: Option<u64>,
        /// The sum of running sandboxes' CPU limits before requests queue, in
        /// CPUs (e.g. 32). Default: sixteen times the host's.
        #[arg(long, value_name = "CPUS")]
        max_cpus: Option<u32>,
        /// Sandboxes one token may hold at once; its requests past that wait
        /// for its own to go.
        #[arg(long, value_name = "N")]
        token_max_sandboxes: Option<u64>,
        /// Close a connection whose request headers have not arrived whole
        /// this long after the server began waiting for them, e.g. 10s.
        #[arg(long, default_value = "10s", value_name = "DURATION", value_parser = humantime::parse_duration)]
        header_timeout: std::time::Duration,
        /// Close a connection with no request in progress after this long.
        #[arg(long, default_value = "2m", value_name = "DURATION", value_parser = humantime::parse_duration)]
        idle_timeout: std::time::Duration,
        /// Close a connection whose client reads nothing of an answer for
        /// this long.
        #[arg(long, default_value = "60s", value_name = "DURATION", value_parser = humantime::parse_duration)]
        write_timeout: std::time::Duration,
        /// Connections at once per listener (lowered to fit the descriptor
        /// limit); when full, the connection idle longest makes room.
        #[arg(long, default_value_t = 4096, value_name = "N")]
        max_connections: usize,
        /// Connections at once from one address on each TCP listener.
        #[arg(long, default_value_t = 256, value_name = "N")]
        max_connections_per_peer: usize,
        /// Descriptors TCP connections never take, kept for the Unix
        /// socket, sandboxes' init connections and the state store.
        #[arg(long, default_value_t = 1024, value_name = "N")]
        fd_reserve: u64,
        /// A host name a listener on a loopback address answers to besides
        /// localhost, 127.0.0.1 and [::1] (repeatable): for a proxy on this
        /// host that passes its public name on. Requests naming any other
        /// host in Host or Origin get 403 (protection against DNS
        /// rebinding, docs/security.md).
        #[arg(long = "allowed-host", value_name = "NAME")]
        allowed_host: Vec<String>,
        /// Print the OpenAPI document and exit.
        #[arg(long)]
        openapi: bool,
    },
    /// Serve Cairn's tools (docs/tools.md) over MCP on stdin and stdout.
    ///
    /// Speaks MCP 2026-07-28 (stateless, no handshake) and 2025-11-25 and
    /// before (with the initialize handshake); logs go to stderr. Stages it
    /// starts run on its threads: one still running when the client closes
    /// the stream is interrupted, and `cairn pipeline resume RUN` continues it.
    /// With a token (CAIRN_TOKEN in the client's configuration of the
    /// server, or --token), the tools act as its holder: a tenant's token
    /// sees and makes that tenant's objects only, and each call is in
    /// `cairn token log`.
    #[command(
        after_help = "Examples:\n  cairn mcp\n  CAIRN_TOKEN=cairn_… cairn mcp   # as a tenant\n  cairn mcp --schema > tools.json"
    )]
    Mcp {
        /// Print the tool schema (the block in docs/tools.md) and exit.
        #[arg(long)]
        schema: bool,
    },
    /// The built-in agent loop: a model plans toward a goal once per stage
    /// boundary, through the same tools `cairn mcp` serves (docs/agent.md).
    #[command(subcommand)]
    Agent(AgentCommand),
    /// API tokens for `cairn serve --listen` (stored as hashes).
    #[command(subcommand)]
    Token(TokenCommand),
    /// Tenants: groups of tokens that see only their own objects, with
    /// limits on what they hold at once (docs/security.md, "Tenants").
    #[command(subcommand)]
    Tenant(TenantCommand),

    /// Check what Cairn needs on this host; the first step when something
    /// does not work.
    ///
    /// One line per check, `✓ name: detail`, or `✗ name: detail — remedy`
    /// when Cairn cannot run as configured until the remedy is applied, or
    /// `! name: detail — remedy` when only an optional feature needs it;
    /// then whether the native driver can run here. Checked: root, the
    /// kernel, user namespaces (one is made), seccomp, overlayfs, the mount
    /// API, idmapped mounts on the state directory's file system, cgroups
    /// (v1, v2 or hybrid, the controllers, v2 delegation), the layer
    /// mechanism, runsc and its flags (--driver gvisor), nftables and route
    /// netlink (--network egress), the state directory's owner, mode and
    /// free space, and the state and chunk stores --state and --store name
    /// (connected to and read; nothing is written). Nothing is left behind.
    ///
    /// Exits 0 when no check failed, 1 when one did (warnings never fail).
    /// --json prints `{"ok": BOOL, "checks": [{"name", "status": "ok" |
    /// "warn" | "fail", "detail", "remedy"}]}`, `remedy` null on ok lines;
    /// `ok` is the exit status's verdict.
    #[command(
        after_help = "Examples:\n  cairn doctor\n  cairn doctor --json | jq '.checks[] | select(.status != \"ok\")'\n  CAIRN_STATE=postgres://cairn@db:5432/cairn cairn doctor"
    )]
    Doctor {
        /// Print JSON for scripts instead of text.
        #[arg(long)]
        json: bool,
    },
    /// The attacker of `cairn bench api`'s flood, in a process of its own
    /// (descriptors are counted per process): holds CONNECTIONS half-open
    /// connections to TO from 127.0.2.1 and the next ADDRESSES - 1
    /// addresses, trickling a header line every 5 s, until stdin closes;
    /// prints `open N` as the count changes and the lives of the
    /// connections the server closed, as JSON, at the end.
    #[command(hide = true)]
    BenchFlood {
        #[arg(long)]
        to: std::net::SocketAddr,
        #[arg(long)]
        connections: usize,
        #[arg(long)]
        addresses: usize,
    },
    /// Measure Cairn against the targets (and bwrap/crun where installed).
    Bench {
        /// What to measure.
        #[arg(value_enum, default_values_t = vec![crate::bench::Which::Start, crate::bench::Which::Exec, crate::bench::Which::Cp, crate::bench::Which::Throughput])]
        which: Vec<crate::bench::Which>,
        /// Runs per measurement.
        #[arg(long, default_value_t = 200)]
        runs: usize,
        /// sessions: how many entries the context log is filled to.
        #[arg(long, default_value_t = 1_000_000)]
        entries: u64,
        /// sessions: the files a suspended and resumed session holds, e.g. 1G,
        /// 256M; scale: the size of the snapshot restored cold and warm.
        #[arg(long, default_value = "1G", value_name = "SIZE", value_parser = parse_bytes)]
        size: u64,
        /// gvisor-memory: the random bytes the sandbox holds in its tmpfs.
        #[arg(long, default_value = "512M", value_name = "SIZE", value_parser = parse_bytes)]
        memory: u64,
        /// scale: an empty PostgreSQL database for the queue figures
        /// (postgres://…); without it they are taken on SQLite. The cold
        /// restore uses --store (or CAIRN_STORE), an s3:// store.
        #[arg(long, value_name = "URL")]
        postgres: Option<String>,
        /// drift: how many sandboxes write files and are removed between
        /// the fresh figure and the one after.
        #[arg(long, default_value_t = 2000, value_name = "N")]
        churn: usize,
        /// start: another `cairn` binary (an earlier build, say) timed in
        /// the same rounds as this one and bwrap, in a state directory of
        /// its own; its ratio to this build's figure is printed.
        #[arg(long, value_name = "PATH")]
        against: Option<std::path::PathBuf>,
        /// Print JSON for scripts instead of text.
        #[arg(long)]
        json: bool,
    },
}

// The spellings of `cairn pipeline show|approve|reject` before pipeline
// runs had one noun; each still works with a note on stderr, for one release.
#[derive(Subcommand)]
#[command(defer = true)]
pub enum RunCommand {
    /// Deprecated: `cairn pipeline show`.
    #[command(hide = true)]
    Show {
        run: String,
        /// Print JSON for scripts instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Deprecated: `cairn pipeline approve`.
    #[command(hide = true)]
    Approve {
        run: String,
        stage: String,
        #[arg(long, value_name = "TEXT")]
        reason: Option<String>,
        #[arg(long)]
        no_continue: bool,
        #[command(flatten)]
        model: PipelineModelArgs,
    },
    /// Deprecated: `cairn pipeline reject`.
    #[command(hide = true)]
    Reject {
        run: String,
        stage: String,
        #[arg(long, value_name = "TEXT", required = true)]
        reason: String,
    },
}

// What a person decides about a stage waiting for approval.
#[derive(Subcommand)]
#[command(defer = true)]
pub enum VerdictCommand {
    /// Approve a stage that waits for a person (`approve = true`), then
    /// continue the run here, like `cairn pipeline resume`.
    ///
    /// Records who approved it ($USER, or the uid) and the reason first, so
    /// a kill before the run goes on loses nothing: `cairn pipeline resume
    /// RUN` continues it. Exits 0 when the run completes, 1 when it fails,
    /// 3 when it stops at another stage waiting for approval.
    Approve {
        /// Run id or unique prefix.
        run: String,
        /// The stage waiting for approval.
        stage: String,
        /// Why, recorded with the approval (at most 4 KiB).
        #[arg(long, value_name = "TEXT")]
        reason: Option<String>,
        /// Only record the approval; `cairn pipeline resume RUN` continues the run.
        #[arg(long)]
        no_continue: bool,
        #[command(flatten)]
        model: PipelineModelArgs,
    },
    /// Reject a stage that waits for a person: the run fails there, with
    /// who rejected it and why. The stage does not run and goes to no
    /// dead-letter queue; start a new run to try again (completed stage keys
    /// are reused).
    Reject {
        /// Run id or unique prefix.
        run: String,
        /// The stage waiting for approval.
        stage: String,
        /// Why (required, at most 4 KiB).
        #[arg(long, value_name = "TEXT", required = true)]
        reason: String,
    },
}

#[derive(Args, Clone)]
pub struct WorkerArgs {
    /// Jobs this worker runs at once (a run waiting for its branches does
    /// not hold one).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub slots: u32,
    /// Seconds a claim holds without a heartbeat; a worker silent this long
    /// is presumed dead and its jobs go to others.
    #[arg(long, value_name = "SECS", default_value_t = 30.0)]
    pub lease: f64,
    /// Seconds between looks at the queue when no wake-up comes.
    #[arg(long, value_name = "SECS", default_value_t = 1.0)]
    pub poll: f64,
    /// Exit once the queue was empty and nothing ran for this many seconds.
    #[arg(long, value_name = "SECS")]
    pub idle_exit: Option<f64>,
    /// One JSON object per line for each job claimed, ended or lost.
    #[arg(long)]
    pub json: bool,
}

#[derive(Subcommand)]
#[command(defer = true)]
pub enum WorkerCommand {
    /// The workers that ever registered on this state store.
    Ls {
        /// Print JSON for scripts instead of text.
        #[arg(long)]
        json: bool,
    },
    /// The stage queue: runs and branches, their claims and leases.
    Jobs {
        /// Print JSON for scripts instead of text.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
#[command(defer = true)]
pub enum PipelineCommand {
    /// Check a pipeline file, then run it; prints the run id.
    ///
    /// Exits 0 when the run completes, 1 when it fails (a stage in the
    /// dead-letter queue, or rejected), and 3 when it stops at a stage with
    /// `approve = true`: the run waits, with no process, until `cairn
    /// pipeline approve RUN STAGE` continues it.
    Run {
        /// The pipeline file (TOML; docs/pipelines.md).
        file: PathBuf,
        /// Set a parameter (repeatable), overriding [params].
        #[arg(long = "param", value_name = "KEY=VALUE")]
        params: Vec<String>,
        /// Only check the file.
        #[arg(long)]
        check: bool,
        #[command(flatten)]
        model: PipelineModelArgs,
        #[command(flatten)]
        queue: QueueArgs,
    },
    /// Continue a run after a crash or a kill: completed stages are not run again.
    ///
    /// Exits like `pipeline run`: 0 completed, 1 failed, 3 waiting for approval.
    Resume {
        /// Run id or unique prefix.
        run: String,
        #[command(flatten)]
        model: PipelineModelArgs,
        #[command(flatten)]
        queue: QueueArgs,
    },
    /// List pipeline runs: status (`interrupted` when nothing executes a
    /// run recorded as running), pipeline, file.
    Ls {
        /// Print JSON for scripts instead of text.
        #[arg(long)]
        json: bool,
    },
    /// A run's lineage: stages, branches with the winner and why the others
    /// lost, attempts, retries and the checkpoints they restored, decisions,
    /// dead letters, artifacts. `--json` gives the same records, each event
    /// with its typed fields (docs/formats.md, "Run events").
    Show {
        /// Run id or unique prefix.
        run: String,
        /// Print JSON for scripts instead of text.
        #[arg(long)]
        json: bool,
    },
    #[command(flatten)]
    Verdict(VerdictCommand),
}

// Running through the shared stage queue instead of in this process.
#[derive(Args, Clone, Default)]
pub struct QueueArgs {
    /// Queue the run for `cairn worker`s (any host sharing this state store
    /// and remote chunk store) and follow it here; a kill of this command
    /// leaves the run to the workers.
    #[arg(long)]
    pub queue: bool,
    /// With --queue: print the run id and return at once.
    #[arg(long, requires = "queue")]
    pub detach: bool,
}

// The model decide stages ask, over the pipeline file's `[pipeline] model`.
// The API key comes from ANTHROPIC_API_KEY or OPENAI_API_KEY. Flags are not
// remembered: give them again to `pipeline resume`.
#[derive(Args, Clone, Default)]
pub struct PipelineModelArgs {
    /// anthropic or openai.
    #[arg(long, value_name = "PROVIDER")]
    pub provider: Option<String>,
    /// The model's name, e.g. claude-sonnet-4-5.
    #[arg(long, value_name = "NAME")]
    pub model: Option<String>,
    /// Another endpoint for the provider's API (a proxy, a local server).
    #[arg(long, value_name = "URL")]
    pub base_url: Option<String>,
}

#[derive(Subcommand)]
#[command(defer = true)]
pub enum DlqCommand {
    /// List dead letters.
    Ls {
        /// Print JSON for scripts instead of text.
        #[arg(long)]
        json: bool,
    },
    /// One dead letter, with its failure and input snapshots.
    Show {
        /// Dead letter id or unique prefix (`cairn dlq ls`).
        id: String,
    },
    /// Run the stage again (fresh retries), then the rest of its run.
    Retry {
        /// Dead letter id or unique prefix (`cairn dlq ls`).
        id: String,
        #[command(flatten)]
        model: PipelineModelArgs,
    },
}

#[derive(Subcommand)]
#[command(defer = true)]
pub enum ArtifactCommand {
    /// List artifacts (of one run).
    Ls {
        /// Run id or unique prefix; every run's when left out.
        run: Option<String>,
        /// Print JSON for scripts instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Write an artifact's content to a file or stdout (`-`).
    Get {
        /// Artifact id or unique prefix (`cairn artifact ls`).
        id: String,
        /// Where to write it; `-` is standard output.
        #[arg(short, long, default_value = "-")]
        output: PathBuf,
    },
}

#[derive(Subcommand)]
#[command(defer = true)]
pub enum SnapshotCommand {
    /// One snapshot: lineage, sizes, label and, with a remote store,
    /// whether it is durable there (restorable from any host).
    Show {
        /// Snapshot id, unique prefix or label.
        snapshot: String,
        /// Print JSON for scripts instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Forget snapshots; sandboxes and snapshots made from them are unaffected.
    Rm {
        /// Snapshot ids, unique prefixes or labels.
        #[arg(required = true)]
        snapshots: Vec<String>,
    },
    /// Make a snapshot holding the same files in one layer; prints its id.
    ///
    /// Every snapshot of a restored sandbox stacks a layer on its parent's,
    /// and overlayfs mounts at most 500: restore the flattened copy to go
    /// on. File contents are shared, not copied; only the layer's index is
    /// new. Sessions flatten their own snapshots as they suspend.
    Flatten {
        /// Snapshot id, unique prefix or label.
        snapshot: String,
    },
}

#[derive(Subcommand)]
#[command(defer = true)]
pub enum ImageCommand {
    /// Build an image: `busybox` (tiny, static), `debian` (debootstrap
    /// minbase), `code-interpreter` (Debian with Jupyter kernels, for E2B's
    /// code interpreter SDK through `cairn serve --e2b`) or `e2b-base`
    /// (E2B's default template: Debian with bash, python3, pip, git, curl
    /// and the user `user`); or, with --file, from a Dockerfile.
    ///
    /// A Dockerfile's FROM names a Cairn image, busybox, debian[:SUITE]
    /// (built from Debian's packages) or e2bdev/base; RUN, COPY, ADD (local
    /// files), ENV, WORKDIR, USER and ARG run in a sandbox; CMD and
    /// ENTRYPOINT become a command started with each sandbox of the image.
    /// ENV, WORKDIR and USER apply to the image's commands (`cairn run`,
    /// `cairn exec`, the API). Anything else is refused naming its line.
    Build {
        #[arg(value_enum, required_unless_present = "file", conflicts_with = "file")]
        kind: Option<ImageKind>,
        /// Image name (default: the kind; required with --file).
        #[arg(long)]
        name: Option<String>,
        /// Build from this Dockerfile (its subset: see above).
        #[arg(long, short = 'f', value_name = "DOCKERFILE")]
        file: Option<PathBuf>,
        /// The build context COPY reads from (default: the Dockerfile's
        /// directory).
        #[arg(long, value_name = "DIR", requires = "file")]
        context: Option<PathBuf>,
        /// Set an ARG of the Dockerfile (repeatable).
        #[arg(long = "build-arg", value_name = "NAME=VALUE", requires = "file")]
        build_args: Vec<String>,
        /// What the Dockerfile's RUN steps reach: none (the default) or
        /// egress (a route out, e.g. for apt-get and pip; needs nftables).
        #[arg(long, value_name = "MODE", requires = "file", value_parser = ["none", "egress"])]
        network: Option<String>,
        /// Extra Debian packages, comma-separated (the Debian kinds).
        #[arg(long, value_delimiter = ',')]
        packages: Vec<String>,
        /// Debian suite (the Debian kinds; default: the host's).
        #[arg(long)]
        suite: Option<String>,
    },
    /// Import a directory or a tarball (e.g. `docker export` output; plain, gzip or zstd).
    Import {
        /// A directory, or a tarball (plain, gzip or zstd).
        path: PathBuf,
        #[arg(long)]
        name: String,
    },
    /// Give an image a second name (the same layers, no copy), e.g. to
    /// serve one image as two E2B templates on different drivers.
    Tag {
        /// The image to name (`cairn image ls`).
        image: String,
        /// The new name; an image already called so is replaced.
        name: String,
    },
    /// List images.
    Ls {
        /// Print JSON for scripts instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Remove images (sandboxes using them keep their layers).
    Rm {
        /// Image names (`cairn image ls`).
        #[arg(required = true)]
        names: Vec<String>,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum ImageKind {
    Busybox,
    Debian,
    /// Debian with Jupyter's Python kernel, numpy, pandas, matplotlib and
    /// the server E2B's code interpreter SDK talks to (docs/e2b.md).
    CodeInterpreter,
    /// E2B's base template: Debian with bash, python3, pip, git and curl,
    /// and the user `user` (uid 1000) E2B runs commands as.
    E2bBase,
}

#[derive(Subcommand)]
#[command(defer = true)]
pub enum TokenCommand {
    /// Make a token; its secret is printed once, to stdout.
    Create {
        /// A name to tell tokens apart (letters, digits, '-', '_', '.').
        name: String,
        /// A token of this tenant (`cairn tenant create`): it sees, makes and
        /// removes that tenant's sandboxes, snapshots, sessions, runs, images
        /// and E2B sandboxes only. Without it, the token is an administrator.
        #[arg(long, value_name = "TENANT")]
        tenant: Option<String>,
        /// Print JSON for scripts instead of text.
        #[arg(long)]
        json: bool,
    },
    /// List tokens (names and ids; secrets are never shown again).
    Ls {
        /// Print JSON for scripts instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Who did what: the requests made to `cairn serve` (its API, the E2B
    /// API and its sandboxes' envd, /mcp) and the commands run with --token,
    /// with the token and tenant that made each, newest last; kept 30
    /// days. Requests on the Unix socket and commands without a token (the
    /// owner's) are not recorded.
    Log {
        /// Only this tenant's requests.
        #[arg(long, value_name = "TENANT")]
        tenant: Option<String>,
        /// How many of the newest requests to show.
        #[arg(long, short = 'n', default_value_t = 100)]
        limit: u32,
        /// Print JSON for scripts instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Revoke tokens by id or name; requests using them are refused at once.
    Rm {
        /// Token ids or names (`cairn token ls`).
        #[arg(required = true)]
        tokens: Vec<String>,
    },
}

#[derive(Subcommand)]
#[command(defer = true)]
pub enum TenantCommand {
    /// Make a tenant; give its tokens with `cairn token create NAME --tenant T`.
    ///
    /// Limits count the sandboxes it holds (running or stopped, not yet
    /// removed): past one, a create, fork or restore is refused (HTTP 429)
    /// with nothing made.
    Create {
        /// Its name: 1 to 32 lowercase letters and digits (its objects' names
        /// are stored as NAME-…).
        name: String,
        /// At most this many sandboxes at once.
        #[arg(long, value_name = "N")]
        max_sandboxes: Option<u64>,
        /// At most this much memory: the sum of its running sandboxes' limits.
        #[arg(long, value_name = "SIZE", value_parser = parse_bytes)]
        max_memory: Option<u64>,
        /// At most this much disk: the sum of its sandboxes' --disk limits
        /// (then each of its sandboxes needs one).
        #[arg(long, value_name = "SIZE", value_parser = parse_bytes)]
        max_disk: Option<u64>,
        /// Print JSON for scripts instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Change a tenant's limits; those not given are kept.
    ///
    /// A limit lowered below what the tenant holds takes nothing away: its
    /// next sandbox past the limit is refused.
    #[command(
        after_help = "Examples:\n  cairn tenant set acme --max-sandboxes 40\n  cairn tenant set acme --max-memory none"
    )]
    Set {
        /// The tenant (`cairn tenant ls`).
        name: String,
        /// At most this many sandboxes at once, or `none`.
        #[arg(long, value_name = "N|none", value_parser = parse_limit_count)]
        max_sandboxes: Option<Limit>,
        /// At most this much memory (the sum of its running sandboxes'
        /// limits), or `none`.
        #[arg(long, value_name = "SIZE|none", value_parser = parse_limit_bytes)]
        max_memory: Option<Limit>,
        /// At most this much disk (the sum of its sandboxes' --disk
        /// limits), or `none`.
        #[arg(long, value_name = "SIZE|none", value_parser = parse_limit_bytes)]
        max_disk: Option<Limit>,
        /// Print JSON for scripts instead of text.
        #[arg(long)]
        json: bool,
    },
    /// List tenants with their limits and what they hold now.
    Ls {
        /// Print JSON for scripts instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Remove tenants: their tokens stop working at once (401), E2B access
    /// tokens they issued with them; what they still own (snapshots,
    /// finished runs, images, closed sessions) passes to the administrator.
    Rm {
        /// Tenant names (`cairn tenant ls`).
        #[arg(required = true)]
        tenants: Vec<String>,
        /// Remove their sandboxes and close their sessions first; without it
        /// a tenant that holds any is refused.
        #[arg(long, short)]
        force: bool,
    },
}

/// A limit `tenant set` gives: a value, or none (`none`).
#[derive(Clone, Copy, Debug)]
pub struct Limit(pub Option<u64>);

fn parse_limit_count(s: &str) -> Result<Limit, String> {
    if s == "none" {
        return Ok(Limit(None));
    }
    s.parse::<u64>()
        .map(|n| Limit(Some(n)))
        .map_err(|_| format!("expected a whole number or `none`, got {s:?}"))
}

fn parse_limit_bytes(s: &str) -> Result<Limit, String> {
    if s == "none" {
        return Ok(Limit(None));
    }
    parse_bytes(s).map(|n| Limit(Some(n)))
}

/// A DNS domain: labels of letters, digits and hyphens, lowercased.
fn parse_domain(s: &str) -> Result<String, String> {
    let d = s.trim().trim_end_matches('.').to_ascii_lowercase();
    let label_ok =
        |l: &str| !l.is_empty() && l.len() <= 63 && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    if d.len() > 200 || !d.split('.').all(label_ok) {
        return Err(format!("{s:?} is not a domain name (e.g. sandboxes.example.com)"));
    }
    Ok(d)
}

/// A byte count: a number with an optional K, M, G or T suffix (powers of 1024).
fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (digits, shift) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => return Err(format!("{s:?}: the suffix is K, M, G or T")),
            };
            (&t[..i], shift)
        }
        _ => (t, 0),
    };
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{s:?} is not a size like 512M or 4G"))?;
    n.checked_mul(1 << shift)
        .filter(|n| *n > 0)
        .ok_or_else(|| format!("{s:?} is not a size between 1 byte and 16E"))
}

#[derive(Subcommand)]
#[command(defer = true)]
pub enum SessionCommand {
    /// Start a session: a sandbox and an empty log; prints the session id.
    Create {
        /// Image to start from (default: busybox).
        #[arg(long)]
        image: Option<String>,
        /// `native` (the default) or `gvisor`.
        #[arg(long)]
        driver: Option<String>,
        /// A name to find it by (letters, digits, '-', '_').
        #[arg(long)]
        name: Option<String>,
        /// Suspend after this long without use (e.g. 90s, 5m, 1h): `cairn
        /// serve` snapshots and stops an idle session, and the next exec,
        /// file call or user message resumes it.
        #[arg(long, value_name = "DURATION")]
        idle: Option<String>,
        /// The network of the session's sandboxes, kept across suspends.
        #[command(flatten)]
        network: NetworkArgs,
    },
    /// List sessions.
    Ls {
        /// Draw the lineage: each fork under its parent, with the entry it
        /// forked at and the reason given.
        #[arg(long, conflicts_with = "json")]
        tree: bool,
        /// Print JSON for scripts instead of text.
        #[arg(long)]
        json: bool,
    },
    /// One session: state, sandbox, newest snapshot, lineage.
    Show {
        /// Session id, unique id prefix (3+ characters) or name.
        id: String,
        /// Print JSON for scripts instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Print the live log (entries a rewind abandoned are not shown).
    Log {
        /// Session id, unique id prefix (3+ characters) or name.
        id: String,
        /// Start at this entry.
        #[arg(long, value_name = "N", conflicts_with = "tail")]
        from: Option<u64>,
        /// Only the last N entries.
        #[arg(long, value_name = "N")]
        tail: Option<usize>,
        /// One JSON entry per line.
        #[arg(long)]
        json: bool,
    },
    /// Append an entry to the log; prints its seq.
    Append {
        /// Session id, unique id prefix (3+ characters) or name.
        id: String,
        /// Who speaks.
        #[arg(long, value_parser = ["user", "assistant", "system"], required_unless_present = "json")]
        role: Option<String>,
        /// The text of the message.
        #[arg(long, required_unless_present = "json", conflicts_with = "json")]
        content: Option<String>,
        /// A whole entry as JSON: {"kind": "note", "content": "…", …} (docs/sessions.md).
        #[arg(long, value_name = "ENTRY", conflicts_with = "role")]
        json: Option<String>,
    },
    /// Run a command in the session's sandbox and record it in the log.
    ///
    /// A suspended session is resumed first; a sandbox that died is
    /// restored from the newest snapshot (a `recovered` entry names the
    /// calls whose effects were lost). Exits with the command's status.
    /// The environment, working directory and timeout are recorded with
    /// the command (a replay runs it the same way); stdin is not taken.
    Exec {
        /// Session id, unique id prefix (3+ characters) or name.
        id: String,
        #[command(flatten)]
        process: ProcessArgs,
        /// The command and its arguments.
        #[arg(last = true, required = true, value_name = "CMD")]
        cmd: Vec<String>,
    },
    /// Restore a session whose sandbox died, and with --replay run again
    /// the tool calls the restore lost.
    ///
    /// The restore is what the next exec would do: the newest snapshot the
    /// log records, with a `recovered` entry naming the calls whose effects
    /// were lost. --replay then re-runs those exec calls in order (each
    /// recorded anew, naming the original as `replay_of`) and stops at the
    /// first whose exit status differs from the one the log recorded; exits
    /// 1 when it stopped early.
    Recover {
        /// Session id, unique id prefix (3+ characters) or name.
        id: String,
        /// Re-run the lost tool calls.
        #[arg(long)]
        replay: bool,
        /// Print the report as JSON (the commands' output goes to stderr).
        #[arg(long)]
        json: bool,
    },
    /// Snapshot the session's sandbox and remove it; `resume` brings it back.
    ///
    /// Refused while a command runs in the session (it is not taken from
    /// under the command); retry when it ends.
    Suspend {
        /// Session id, unique id prefix (3+ characters) or name.
        id: String,
    },
    /// Restore a suspended session's sandbox from its newest snapshot (also
    /// finishes a suspend or resume that was interrupted).
    Resume {
        /// Session id, unique id prefix (3+ characters) or name.
        id: String,
    },
    /// Start a new session from entry N: it shares the log up to N and its
    /// sandbox is restored from the snapshot at or before N; prints its id.
    Fork {
        /// Session id, unique id prefix (3+ characters) or name.
        id: String,
        /// The last entry the fork shares.
        #[arg(long, value_name = "N")]
        at: u64,
        /// Why (kept in the lineage).
        #[arg(long)]
        reason: String,
        /// A name for the new session.
        #[arg(long)]
        name: Option<String>,
    },
    /// Move the live branch back to entry N; later entries stay in the log,
    /// abandoned (the sandbox is not changed).
    Rewind {
        /// Session id, unique id prefix (3+ characters) or name.
        id: String,
        #[arg(long, value_name = "N")]
        to: u64,
    },
    /// Walk the log's hash chain; exits 1 naming the first bad entry.
    Verify {
        /// Session id, unique id prefix (3+ characters) or name.
        id: String,
    },
    /// Close a session and remove its sandbox; the log stays unless --purge.
    Rm {
        /// Session id, unique id prefix (3+ characters) or name.
        id: String,
        /// Delete the log too.
        #[arg(long)]
        purge: bool,
    },
    /// Write a session to one file another state directory can import.
    ///
    /// The file holds the session's whole log (every entry its hash chain
    /// covers, with the rewinds that apply), its large payloads, and every
    /// snapshot its log names with all the stored objects a restore reads,
    /// the image's layers included. An active session's sandbox is
    /// snapshotted first (recorded in its log as a `note`), so the file
    /// holds the machine as it is now. Format: docs/formats.md ("Session
    /// bundle").
    Export {
        /// Session id, unique id prefix (3+ characters) or name.
        id: String,
        /// Where to write it; `-` or nothing: standard output, which must
        /// not be a terminal. A file is written whole or not at all.
        #[arg(short, long, value_name = "FILE")]
        output: Option<std::path::PathBuf>,
    },
    /// Record the session a `cairn session export` file holds as a new
    /// session here; prints its id.
    ///
    /// It gets a new id, keeps its name unless --name is given, and is
    /// suspended: `cairn session resume` or `cairn session exec` brings it
    /// back on its newest snapshot. Its log shows the same entries, seqs and
    /// hashes as the exported one's live log, and `cairn session verify`
    /// checks it. The file is checked whole (every object against its hash,
    /// the log's chain) before anything is recorded; a refused file leaves
    /// no session, and `cairn gc` removes any objects it stored.
    Import {
        /// The bundle, or `-` for standard input.
        #[arg(value_name = "FILE")]
        file: String,
        /// The name for the imported session (default: the one it had).
        #[arg(long)]
        name: Option<String>,
        /// Print what was imported as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
#[command(defer = true)]
pub enum AgentCommand {
    /// Start an agent on a goal and drive it until the model ends its turn,
    /// a limit is reached or the model is unavailable.
    ///
    /// The model is called once per stage boundary with the goal, the
    /// conversation and a compact lineage; its tool calls run durably
    /// (stages in parallel). Every reply, with its tokens and cost, and
    /// every result is recorded in the agent's context log before the loop
    /// goes on, so a killed loop continues with `cairn agent resume`
    /// without asking the model again or running a stage twice.
    ///
    /// The API key comes from ANTHROPIC_API_KEY or OPENAI_API_KEY and is
    /// never recorded. Exit status: 0 completed, 1 failed (the provider
    /// refused: fix the cause and resume), 3 stopped at the stage limit or
    /// the budget (resume with a higher one), 75 paused because the model
    /// was unavailable after its retries (resume later).
    #[command(after_help = "Examples:\n  \
        cairn agent run --goal \"find the fastest compression level\" --provider anthropic --model claude-sonnet-4-5\n  \
        cairn agent run --goal \"...\" --pipeline examples/agent-sweep.toml --max-stages 8 --budget-usd 0.50\n  \
        cairn agent run --goal \"...\" --provider openai --base-url http://127.0.0.1:8080/v1 --model llama-3.1-8b \\\n      \
        --price-in 0 --price-out 0")]
    Run {
        /// What the model is to achieve, in words.
        #[arg(long)]
        goal: String,
        /// Run this pipeline file first; its stages' outputs are the
        /// snapshots the model plans against.
        #[arg(long, value_name = "FILE", conflicts_with_all = ["snapshot", "image"])]
        pipeline: Option<std::path::PathBuf>,
        /// Start from this snapshot.
        #[arg(long, conflicts_with = "image")]
        snapshot: Option<String>,
        /// Start from a fresh sandbox of this image (default: busybox).
        #[arg(long)]
        image: Option<String>,
        #[command(flatten)]
        model: ModelArgs,
        /// The most stages the model may start (each run_stage or fork_from
        /// call is one; a fork_from group of hypotheses is one).
        #[arg(long, default_value_t = 10)]
        max_stages: u32,
        /// Stop once the model calls cost this many US dollars.
        #[arg(long, value_name = "USD")]
        budget_usd: Option<f64>,
        /// Print JSON for scripts instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Continue an agent that was killed, paused or stopped.
    Resume {
        /// Agent name (agent-…), session id or unique id prefix.
        agent: String,
        /// Raise the stage limit.
        #[arg(long)]
        max_stages: Option<u32>,
        /// Raise the budget.
        #[arg(long, value_name = "USD")]
        budget_usd: Option<f64>,
        /// Print JSON for scripts instead of text.
        #[arg(long)]
        json: bool,
    },
    /// One agent: its goal, status, each round's reply, calls and results,
    /// tokens and cost.
    Show {
        /// Agent name (agent-…), session id or unique id prefix.
        agent: String,
        /// Print JSON for scripts instead of text.
        #[arg(long)]
        json: bool,
    },
    /// List agents.
    Ls {
        /// Print JSON for scripts instead of text.
        #[arg(long)]
        json: bool,
    },
}

#[derive(clap::Args)]
pub struct ModelArgs {
    /// `anthropic` (Messages API) or `openai` (Chat Completions; also
    /// llama.cpp, vLLM, Ollama with --base-url). Default: the one whose
    /// API key is set, Anthropic first.
    #[arg(long)]
    pub provider: Option<String>,
    /// The model's name (default: claude-sonnet-4-5 or gpt-4.1).
    #[arg(long)]
    pub model: Option<String>,
    /// Another endpoint: Anthropic's is given without /v1, OpenAI's with
    /// it (as their SDKs take them).
    #[arg(long, value_name = "URL")]
    pub base_url: Option<String>,
    /// The most tokens one reply may have.
    #[arg(long, default_value_t = 4096)]
    pub max_tokens: u32,
    /// Seconds one model call may take.
    #[arg(long, default_value_t = 300)]
    pub timeout: u64,
    /// Retries of a call when the model is unavailable (timeouts, 429,
    /// 5xx), with exponential backoff.
    #[arg(long, default_value_t = 5)]
    pub retries: u32,
    /// The first wait between retries, in milliseconds; it doubles.
    #[arg(long, default_value_t = 1000, value_name = "MS")]
    pub backoff_ms: u64,
    /// US dollars per million input tokens, for a model the price table
    /// does not know.
    #[arg(long, value_name = "USD", requires = "price_out")]
    pub price_in: Option<f64>,
    /// US dollars per million output tokens.
    #[arg(long, value_name = "USD", requires = "price_in")]
    pub price_out: Option<f64>,
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent_when_built_whole() {
        super::Cli::command().debug_assert();
    }

    #[test]
    fn no_argument_struct_or_subcommand_enum_has_a_doc_comment_of_its_own() {
        let source = include_str!("cli.rs");
        let lines: Vec<&str> = source.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let derives = line.starts_with("#[derive(") && (line.contains("Args") || line.contains("Subcommand"));
            if derives && i > 0 {
                assert!(
                    !lines[i - 1].starts_with("///"),
                    "line {}: a doc comment on a deferred item replaces its command's help; use //",
                    i
                );
            }
        }
    }
}
