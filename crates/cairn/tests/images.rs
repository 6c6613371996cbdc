//! End-to-end: images built from Debian's tools and imported from tarballs.

mod common;

use std::process::Command;

use common::{skip, stderr, Home};

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
