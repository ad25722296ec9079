//! The example programs build and answer `--help` (this test also makes `cargo test
//! --workspace` build them, so the end-to-end tests can run them as worker processes).

#[test]
fn examples_answer_help() {
    for exe in [env!("CARGO_BIN_EXE_writer"), env!("CARGO_BIN_EXE_reader")] {
        let out = std::process::Command::new(exe)
            .arg("--help")
            .output()
            .expect("run example");
        assert!(out.status.success(), "{exe} --help failed");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("Usage"), "{exe} --help printed: {text}");
    }
}
