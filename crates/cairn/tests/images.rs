//! End-to-end: images built from Debian's tools and imported from tarballs.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use common::{skip, stderr, Home};

/// The permission bits of `rel` in the layer at `layer`, not following a
/// final link.
fn mode(layer: &Path, rel: &str) -> u32 {
    let path = layer.join(rel);
    let meta = std::fs::symlink_metadata(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    meta.permissions().mode() & 0o7777
}

/// The layer of image `name` in `home`.
fn layer_of(home: &Home, name: &str) -> std::path::PathBuf {
    let images: serde_json::Value = serde_json::from_str(&home.ok(&["image", "ls", "--json"])).unwrap();
    let image = images
        .as_array()
        .and_then(|all| all.iter().find(|i| i["name"] == name))
        .unwrap_or_else(|| panic!("no image {name}"));
    home.path().join("layers").join(image["layers"][0].as_str().unwrap())
}

/// In a sandbox of `image`, on each driver this host has: `/` and `/etc`
/// are 0755 and `/etc/passwd` 0644, and `nobody` runs `/bin/sh`.
fn a_non_root_user_runs_the_shell(home: &Home, image: &str, drivers: &[&str]) {
    let script = "stat -c '%a %n' / /etc /etc/passwd; \
        su -s /bin/sh nobody -c 'id -u; /bin/sh -c \"echo the shell ran\"'";
    for driver in drivers {
        let out = home.ok(&["run", "--image", image, "--driver", driver, "--", "sh", "-c", script]);
        assert_eq!(
            out, "755 /\n755 /etc\n644 /etc/passwd\n65534\nthe shell ran",
            "{image} on {driver}"
        );
    }
}

/// The drivers this host runs: native always, gVisor with runsc.
fn drivers(test: &str) -> Vec<&'static str> {
    let mut drivers = vec!["native"];
    if Command::new("runsc").arg("--version").output().is_ok() {
        drivers.push("gvisor");
    } else {
        common::skipped(&format!("{test} on gVisor: runsc is not installed"));
    }
    drivers
}

#[test]
fn the_busybox_image_is_built_with_explicit_modes_whatever_the_umask() {
    let test = "the_busybox_image_is_built_with_explicit_modes_whatever_the_umask";
    if skip(test) {
        return;
    }
    // `cairn` itself runs with umask 077; a fresh build, not the shared
    // one, so that this build's modes are what is checked.
    let home = Home::empty();
    let out = home.cairn(&["image", "build", "busybox", "--name", "bb"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let layer = layer_of(&home, "bb");
    for (rel, want) in [
        ("", 0o755),
        ("bin", 0o755),
        ("usr", 0o755),
        ("usr/bin", 0o755),
        ("var", 0o755),
        ("etc", 0o755),
        ("etc/passwd", 0o644),
        ("etc/group", 0o644),
        ("bin/busybox", 0o755),
        ("tmp", 0o1777),
        ("var/tmp", 0o1777),
        ("root", 0o700),
    ] {
        assert_eq!(mode(&layer, rel), want, "/{rel} is {:o}", mode(&layer, rel));
    }
    a_non_root_user_runs_the_shell(&home, "bb", &drivers(test));
}

/// The attack on `main`: edits under `layers/<id>` (a file, a setuid bit)
/// flowed into every later sandbox. Cairn seals each layer it puts in
/// place; the next process to use a changed layer sets it aside and
/// rebuilds it from the store, so sandboxes see the image as built.
#[test]
fn a_layer_edited_on_the_host_is_rebuilt_from_the_store_before_use() {
    if skip("a_layer_edited_on_the_host_is_rebuilt_from_the_store_before_use") {
        return;
    }
    let home = Home::new();
    let layer = layer_of(&home, "busybox");
    assert_eq!(
        mode(&home.path().join("layers"), ""),
        0o700,
        "layers/ is the owner's alone"
    );
    let before = home.ok(&[
        "run",
        "--",
        "sh",
        "-c",
        "cat /etc/passwd | head -1; stat -c %a /bin/busybox",
    ]);
    std::fs::write(layer.join("etc/passwd"), "root::0:0:planted:/root:/bin/sh\n").unwrap();
    std::fs::set_permissions(layer.join("bin/busybox"), std::fs::Permissions::from_mode(0o4755)).unwrap();
    let after = home.ok(&[
        "run",
        "--",
        "sh",
        "-c",
        "cat /etc/passwd | head -1; stat -c %a /bin/busybox",
    ]);
    assert_eq!(after, before, "an edit to the layer on the host reached a sandbox");
    assert_eq!(mode(&layer, "bin/busybox"), 0o755);
    let aside: Vec<String> = std::fs::read_dir(home.path().join("layers"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".changed-"))
        .collect();
    assert_eq!(aside.len(), 1, "the changed copy is kept aside for inspection");
    let gc = home.cairn(&["gc"]);
    assert!(
        stderr(&gc).contains(&aside[0]),
        "gc does not name the changed copy: {}",
        stderr(&gc)
    );
    // A copy set aside more than a day ago goes; the fresh one stays.
    let two_days_ago = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
        - 2 * 24 * 3600 * 1_000_000_000;
    let old = home.path().join("layers").join(format!(
        ".changed-{layer_name}-{two_days_ago}",
        layer_name = layer.file_name().unwrap().to_string_lossy()
    ));
    std::fs::create_dir_all(old.join("etc")).unwrap();
    std::fs::write(old.join("etc/passwd"), "old\n").unwrap();
    let report: serde_json::Value = serde_json::from_str(&home.ok(&["gc", "--json"])).unwrap();
    let names = |field: &str| -> Vec<String> {
        report[field]
            .as_array()
            .unwrap_or_else(|| panic!("no {field} in {report}"))
            .iter()
            .map(|p| p.as_str().unwrap().rsplit('/').next().unwrap().to_string())
            .collect()
    };
    assert_eq!(names("changed_copies_kept"), [aside[0].clone()], "{report}");
    assert_eq!(
        names("changed_copies_removed"),
        [old.file_name().unwrap().to_string_lossy().into_owned()],
        "{report}"
    );
    assert!(!old.exists() && home.path().join("layers").join(&aside[0]).is_dir());
}

#[test]
fn a_debian_image_with_extra_packages_runs_them() {
    if skip("a_debian_image_with_extra_packages_runs_them") {
        return;
    }
    if Command::new("debootstrap").arg("--version").output().is_err() {
        common::skipped(
            "a_debian_image_with_extra_packages_runs_them: debootstrap is not installed; apt-get install debootstrap",
        );
        return;
    }
    let home = Home::new();
    let out = home.cairn(&["image", "build", "debian", "--packages", "jq", "--name", "deb-jq"]);
    if !out.status.success() && stderr(&out).contains("Failed getting release file") {
        common::skipped(&format!(
            "a_debian_image_with_extra_packages_runs_them: the Debian mirror is unreachable: {}",
            stderr(&out)
        ));
        return;
    }
    assert!(out.status.success(), "{}", stderr(&out));
    // Built by `cairn` under its umask 077: what debootstrap and the
    // package scripts write has the modes a usual host gives it.
    let layer = layer_of(&home, "deb-jq");
    for (rel, want) in [
        ("", 0o755),
        ("etc", 0o755),
        ("etc/apt", 0o755),
        ("etc/apt/sources.list", 0o644),
        ("etc/passwd", 0o644),
        ("usr/bin", 0o755),
        ("usr/bin/dash", 0o755),
        ("usr/bin/jq", 0o755),
        ("var/lib/dpkg/status", 0o644),
        ("tmp", 0o1777),
    ] {
        assert_eq!(mode(&layer, rel), want, "/{rel} is {:o}", mode(&layer, rel));
    }
    a_non_root_user_runs_the_shell(
        &home,
        "deb-jq",
        &drivers("a_debian_image_with_extra_packages_runs_them"),
    );
    let got = home.ok(&[
        "run",
        "--image",
        "deb-jq",
        "--",
        "sh",
        "-c",
        "echo '{\"answer\": 42}' | jq .answer; cat /etc/debian_version",
    ]);
    let mut lines = got.lines();
    assert_eq!(lines.next(), Some("42"));
    assert!(
        lines
            .next()
            .is_some_and(|v| v.chars().next().is_some_and(|c| c.is_ascii_digit())),
        "{got}"
    );
}

#[test]
fn directories_an_archive_leaves_out_are_made_0755_and_its_own_modes_are_kept() {
    if skip("directories_an_archive_leaves_out_are_made_0755_and_its_own_modes_are_kept") {
        return;
    }
    let home = Home::empty();
    let work = tempfile::tempdir().unwrap();
    let src = work.path().join("src");
    std::fs::create_dir_all(src.join("deep/dir")).unwrap();
    for (file, mode) in [("deep/dir/private", 0o640), ("deep/dir/setuid", 0o4755)] {
        std::fs::write(src.join(file), "x").unwrap();
        std::fs::set_permissions(src.join(file), std::fs::Permissions::from_mode(mode)).unwrap();
    }
    // Two files and no directory entry at all, the root's included.
    let tarball = work.path().join("files.tar");
    let status = Command::new("tar")
        .arg("-C")
        .arg(&src)
        .arg("-cf")
        .arg(&tarball)
        .args(["--no-recursion", "deep/dir/private", "deep/dir/setuid"])
        .status()
        .unwrap();
    assert!(status.success());
    home.ok(&["image", "import", tarball.to_str().unwrap(), "--name", "files"]);
    let layer = layer_of(&home, "files");
    for (rel, want) in [
        ("", 0o755),
        ("deep", 0o755),
        ("deep/dir", 0o755),
        ("deep/dir/private", 0o640),
        ("deep/dir/setuid", 0o4755),
    ] {
        assert_eq!(mode(&layer, rel), want, "/{rel} is {:o}", mode(&layer, rel));
    }
}

#[test]
fn a_gzipped_tarball_imports_and_a_bad_one_is_refused() {
    if skip("a_gzipped_tarball_imports_and_a_bad_one_is_refused") {
        return;
    }
    let home = Home::new();
    let layer = home.busybox_layer();
    let work = tempfile::tempdir().unwrap();
    let tarball = work.path().join("root.tar.gz");
    let status = Command::new("tar")
        .arg("-C")
        .arg(&layer)
        .arg("-czf")
        .arg(&tarball)
        .arg(".")
        .status()
        .unwrap();
    assert!(status.success());
    home.ok(&["image", "import", tarball.to_str().unwrap(), "--name", "fromtar"]);
    assert_eq!(
        home.ok(&["run", "--image", "fromtar", "--", "sh", "-c", "echo imported"]),
        "imported"
    );
    let listing = home.ok(&["image", "ls"]);
    assert!(listing.contains("fromtar"), "{listing}");

    let junk = work.path().join("junk.tar");
    std::fs::write(&junk, b"this is not a tarball at all, not even close........").unwrap();
    let out = home.cairn(&["image", "import", junk.to_str().unwrap(), "--name", "junk"]);
    assert_eq!(out.status.code(), Some(125));
    assert!(stderr(&out).contains("cannot import"), "{}", stderr(&out));
    let out = home.cairn(&["image", "import", "/no/such/path", "--name", "gone"]);
    assert_eq!(out.status.code(), Some(125));
    let out = home.cairn(&["image", "import", tarball.to_str().unwrap(), "--name", "Bad Name"]);
    assert!(stderr(&out).contains("invalid image name"), "{}", stderr(&out));
    assert!(!home.ok(&["image", "ls"]).contains("junk"));
    home.ok(&["image", "rm", "fromtar"]);
    assert!(!home.ok(&["image", "ls"]).contains("fromtar"));
}

#[test]
fn device_nodes_are_left_out_of_imported_directories_and_tarballs() {
    if skip("device_nodes_are_left_out_of_imported_directories_and_tarballs") {
        return;
    }
    let home = Home::new();
    let layer = home.busybox_layer();
    let work = tempfile::tempdir().unwrap();
    let root = work.path().join("root");
    let mut copy = Command::new("cp");
    assert!(copy.arg("-a").arg(&layer).arg(&root).status().unwrap().success());
    // The host's memory and a block device, under paths the sandbox's own
    // /dev does not cover; a fifo is harmless and stays.
    let mode = nix::sys::stat::Mode::from_bits_truncate(0o666);
    nix::sys::stat::mknod(
        &root.join("mem"),
        nix::sys::stat::SFlag::S_IFCHR,
        mode,
        nix::sys::stat::makedev(1, 1),
    )
    .unwrap();
    std::fs::create_dir(root.join("deep")).unwrap();
    nix::sys::stat::mknod(
        &root.join("deep/disk"),
        nix::sys::stat::SFlag::S_IFBLK,
        mode,
        nix::sys::stat::makedev(7, 0),
    )
    .unwrap();
    nix::unistd::mkfifo(&root.join("pipe"), mode).unwrap();
    let tarball = work.path().join("root.tar");
    assert!(Command::new("tar")
        .arg("-C")
        .arg(&root)
        .arg("-cf")
        .arg(&tarball)
        .arg(".")
        .status()
        .unwrap()
        .success());

    for (source, name) in [(&root, "fromdir"), (&tarball, "fromtar")] {
        let out = home.cairn(&["image", "import", source.to_str().unwrap(), "--name", name]);
        assert!(out.status.success(), "{}", stderr(&out));
        let seen = home.ok(&[
            "run",
            "--image",
            name,
            "--",
            "sh",
            "-c",
            "for f in /mem /deep/disk /pipe; do if [ -e $f ] || [ -L $f ]; then echo $f; fi; done",
        ]);
        assert_eq!(seen, "/pipe", "image {name} kept device nodes");
        assert!(stderr(&out).contains("2 device node"), "no warning: {}", stderr(&out));
    }
}

#[test]
fn the_default_image_is_built_where_the_package_lists_are_missing() {
    let test = "the_default_image_is_built_where_the_package_lists_are_missing";
    if skip(test) {
        return;
    }
    if ["/bin/busybox", "/usr/bin/busybox"]
        .iter()
        .any(|p| std::fs::read(p).is_ok_and(|elf| !elf.windows(16).any(|w| w == b"/lib64/ld-linux-")))
    {
        eprintln!("SKIPPED {test}: the host's busybox is static, so no package is fetched");
        return;
    }
    // A fresh machine, as apt sees it: no package lists at all.
    let home = Home::empty();
    let lists = home.path().join("apt-lists");
    std::fs::create_dir_all(lists.join("partial")).unwrap();
    let config = home.path().join("apt.conf");
    std::fs::write(&config, format!("Dir::State::Lists \"{}\";\n", lists.display())).unwrap();
    let out = home
        .command(&["image", "build", "busybox"])
        .env("APT_CONFIG", &config)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("apt-get update"),
        "no word of the update on stderr: {}",
        stderr(&out)
    );
    assert!(
        std::fs::read_dir(&lists).unwrap().count() > 2,
        "apt-get update fetched no lists"
    );
    assert_eq!(home.ok(&["run", "--", "echo", "hi"]), "hi");
}

#[test]
fn a_tag_names_the_same_layers_and_removing_one_name_keeps_the_other() {
    if skip("a_tag_names_the_same_layers_and_removing_one_name_keeps_the_other") {
        return;
    }
    let home = Home::new();
    assert_eq!(home.ok(&["image", "tag", "busybox", "second"]), "second");
    let images: serde_json::Value = serde_json::from_str(&home.ok(&["image", "ls", "--json"])).unwrap();
    let find = |name: &str| {
        images
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["name"] == name)
            .unwrap_or_else(|| panic!("no image {name}: {images}"))
            .clone()
    };
    let (first, second) = (find("busybox"), find("second"));
    assert_eq!(first["layers"], second["layers"]);
    assert_eq!(first["source"], second["source"]);
    let shared = layer_of(&home, "second");
    // Removing the first name keeps the layers the second still names.
    home.ok(&["image", "rm", "busybox"]);
    assert!(shared.is_dir(), "{} went with the first name", shared.display());
    assert_eq!(
        home.ok(&["run", "--image", "second", "--", "sh", "-c", "echo tagged"]),
        "tagged"
    );
    // Bad input: a missing image, a bad name; neither leaves a record.
    let out = home.cairn(&["image", "tag", "no-such-image", "third"]);
    assert_eq!(out.status.code(), Some(125));
    assert!(stderr(&out).contains("no-such-image"), "{}", stderr(&out));
    let out = home.cairn(&["image", "tag", "second", "Bad Name"]);
    assert!(stderr(&out).contains("invalid image name"), "{}", stderr(&out));
    let listing = home.ok(&["image", "ls"]);
    assert!(!listing.contains("third") && !listing.contains("Bad"), "{listing}");
    home.ok(&["image", "rm", "second"]);
    assert!(!shared.exists(), "{} outlived both names", shared.display());
}

#[test]
fn a_dockerfile_builds_an_image_whose_commands_get_its_env_workdir_user_and_start_command() {
    if skip("a_dockerfile_builds_an_image_whose_commands_get_its_env_workdir_user_and_start_command") {
        return;
    }
    let home = Home::new();
    let ctx = tempfile::tempdir().unwrap();
    std::fs::create_dir(ctx.path().join("site")).unwrap();
    std::fs::write(ctx.path().join("site/index.html"), "hello\n").unwrap();
    std::fs::write(ctx.path().join("app.txt"), "app\n").unwrap();
    // A link in the context is not followed out of it.
    std::os::unix::fs::symlink("/etc/shadow", ctx.path().join("site/leak")).unwrap();
    let dockerfile = ctx.path().join("Dockerfile");
    std::fs::write(
        &dockerfile,
        "FROM busybox\n\
         ARG GREETING=hi\n\
         ENV MODE=prod GREETING_USED=$GREETING\n\
         COPY app.txt /srv/\n\
         COPY --chmod=640 site /srv/site\n\
         RUN echo 'user:x:1000:1000::/home/user:/bin/sh' >> /etc/passwd && echo 'user:x:1000:' >> /etc/group \\\n    \
             && mkdir -p /home/user && chown 1000:1000 /home/user\n\
         WORKDIR /srv\n\
         RUN echo \"built with $GREETING\" > built.txt\n\
         USER user\n\
         RUN id -u > /home/user/uid\n\
         CMD [\"httpd\", \"-f\", \"-p\", \"8080\", \"-h\", \"/srv/site\"]\n",
    )
    .unwrap();
    let file = dockerfile.to_str().unwrap();
    assert_eq!(
        home.ok(&[
            "image",
            "build",
            "--file",
            file,
            "--name",
            "web",
            "--build-arg",
            "GREETING=hey"
        ]),
        "web"
    );
    let script = "id -u; pwd; echo $MODE $GREETING_USED; cat built.txt /home/user/uid; \
                  stat -c %a /srv/site/index.html; test -e /srv/site/leak && echo leaked; \
                  for i in $(seq 1 50); do wget -q -O - http://127.0.0.1:8080/ 2>/dev/null && break; sleep 0.1; done";
    assert_eq!(
        home.ok(&["run", "--image", "web", "--", "sh", "-c", script]),
        "1000\n/srv\nprod hey\nbuilt with hey\n1000\n640\nhello",
        "ENV, WORKDIR, USER and CMD hold in the image's sandboxes; the link was not copied"
    );
    assert_eq!(
        home.ok(&["run", "--image", "web", "--user", "root", "--", "id", "-u"]),
        "0"
    );
    let id = home.ok(&["create", "--image", "web"]);
    assert_eq!(home.ok(&["exec", &id, "--", "pwd"]), "/srv");
    assert_eq!(home.ok(&["exec", "--user", "0:0", &id, "--", "id", "-u"]), "0");
    let out = home.cairn(&["exec", "--user", "nobody-here", &id, "--", "true"]);
    assert!(stderr(&out).contains("nobody-here"), "{}", stderr(&out));
    home.ok(&["rm", "--force", &id]);

    // Refused input names its line; a failed step leaves no image and no
    // sandbox behind.
    let before = home.ok(&["image", "ls"]);
    for (text, words) in [
        (
            "FROM busybox\nRUN true\nHEALTHCHECK CMD true\n",
            "line 3: HEALTHCHECK is not supported",
        ),
        ("FROM ubuntu:22.04\n", "pulls from no registry"),
        ("FROM busybox\nCOPY ../outside /x\n", "outside the build context"),
        (
            "FROM busybox\nRUN echo one\nRUN echo failing here; exit 7\n",
            "exited with code 7",
        ),
    ] {
        std::fs::write(&dockerfile, text).unwrap();
        let out = home.cairn(&["image", "build", "--file", file, "--name", "broken"]);
        assert_eq!(out.status.code(), Some(125), "{text}");
        assert!(stderr(&out).contains(words), "{text}: {}", stderr(&out));
    }
    let out = home.cairn(&["image", "build", "--file", file, "--name", "broken"]);
    assert!(
        stderr(&out).contains("Dockerfile line 3") && stderr(&out).contains("failing here"),
        "{}",
        stderr(&out)
    );
    assert_eq!(home.ok(&["image", "ls"]), before, "no image is left of a failed build");
    assert_eq!(home.ok(&["ps", "-q"]), "", "no sandbox is left of a build");
}
