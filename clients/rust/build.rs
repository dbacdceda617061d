//! Generates the gRPC stubs from protos/ferrum_rpc/v1/executor.proto at build time, and
//! the error table from the same file: the `ErrorReason` enum's values with their
//! options (status_code, retryable, outcome_unknown), read from the compiled
//! descriptor set, so no reason is written by hand in Rust.
//!
//! executor.proto imports googleapis' google/rpc/status.proto. Its folder is taken from
//! FERRUM_GOOGLEAPIS_PROTOS (a folder holding google/rpc/), else from the Python
//! package googleapis-common-protos as `python3` (or FERRUM_PYTHON) finds it. The
//! google.rpc messages themselves are tonic-types' (extern_path), not generated here.

use prost::Message;
use std::env;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

fn googleapis_dir() -> PathBuf {
    let has = |d: &Path| d.join("google/rpc/status.proto").exists();
    if let Ok(dir) = env::var("FERRUM_GOOGLEAPIS_PROTOS") {
        let dir = PathBuf::from(dir);
        if has(&dir) {
            return dir;
        }
        panic!("FERRUM_GOOGLEAPIS_PROTOS={} holds no google/rpc/status.proto", dir.display());
    }
    let python = env::var("FERRUM_PYTHON").unwrap_or_else(|_| "python3".into());
    // google.rpc is a namespace package: its first path entry's grandparent is the
    // folder that holds google/rpc/*.proto.
    let out = Command::new(&python)
        .args(["-c", "import google.rpc, pathlib; print(pathlib.Path(list(google.rpc.__path__)[0]).parents[1])"])
        .output();
    if let Ok(out) = out {
        if out.status.success() {
            let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
            if has(&dir) {
                return dir;
            }
        }
    }
    panic!(
        "google/rpc/status.proto not found: set FERRUM_GOOGLEAPIS_PROTOS to a folder holding \
         google/rpc/, or make `{python}` able to import googleapis-common-protos"
    );
}

// The few descriptor fields the error table needs. prost skips unknown fields, and
// prost-types' EnumValueOptions drops extensions, so these messages declare the
// extension numbers of executor.proto's options as ordinary fields.
#[derive(Clone, PartialEq, Message)]
struct FileSet {
    #[prost(message, repeated, tag = "1")]
    file: Vec<FileDesc>,
}
#[derive(Clone, PartialEq, Message)]
struct FileDesc {
    #[prost(string, tag = "1")]
    name: String,
    #[prost(string, tag = "2")]
    package: String,
    #[prost(message, repeated, tag = "5")]
    enum_type: Vec<EnumDesc>,
}
#[derive(Clone, PartialEq, Message)]
struct EnumDesc {
    #[prost(string, tag = "1")]
    name: String,
    #[prost(message, repeated, tag = "2")]
    value: Vec<EnumValueDesc>,
}
#[derive(Clone, PartialEq, Message)]
struct EnumValueDesc {
    #[prost(string, tag = "1")]
    name: String,
    #[prost(int32, tag = "2")]
    number: i32,
    #[prost(message, optional, tag = "3")]
    options: Option<EnumValueOpts>,
}
#[derive(Clone, PartialEq, Message)]
struct EnumValueOpts {
    #[prost(int32, tag = "50001")]
    status_code: i32,
    #[prost(bool, tag = "50002")]
    retryable: bool,
    #[prost(bool, tag = "50003")]
    outcome_unknown: bool,
}

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let proto_root = manifest.join("../../protos").canonicalize().expect("protos/ next to clients/");
    let proto = proto_root.join("ferrum_rpc/v1/executor.proto");
    let googleapis = googleapis_dir();
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    let fds_path = out_dir.join("executor_descriptor.bin");

    println!("cargo:rerun-if-changed={}", proto.display());
    println!("cargo:rerun-if-env-changed=FERRUM_GOOGLEAPIS_PROTOS");
    println!("cargo:rerun-if-env-changed=FERRUM_PYTHON");

    tonic_build::configure()
        .build_server(false)
        .file_descriptor_set_path(&fds_path)
        // bytes fields as bytes::Bytes: logits are views of the received buffer.
        .bytes(["."])
        .extern_path(".google.rpc", "::tonic_types::pb")
        .compile_protos(&[proto.as_path()], &[proto_root.as_path(), googleapis.as_path()])
        .expect("protoc over executor.proto");

    let bytes = std::fs::read(&fds_path).expect("descriptor set");
    let set = FileSet::decode(bytes.as_slice()).expect("descriptor set decodes");
    let file = set
        .file
        .iter()
        .find(|f| f.name == "ferrum_rpc/v1/executor.proto")
        .expect("executor.proto in its descriptor set");
    let reasons = file
        .enum_type
        .iter()
        .find(|e| e.name == "ErrorReason")
        .expect("enum ErrorReason in executor.proto");
    let mut table = String::from(
        "/// The error table, generated from executor.proto's ErrorReason values and options.\n\
         pub const REASONS: &[ReasonRow] = &[\n",
    );
    for v in &reasons.value {
        if v.number == 0 {
            continue;
        }
        let o = v.options.clone().unwrap_or_default();
        assert!(o.status_code != 0, "ErrorReason {} has no status_code option", v.name);
        writeln!(
            table,
            "    ReasonRow {{ name: {:?}, number: {}, status_code: {}, retryable: {}, outcome_unknown: {} }},",
            v.name, v.number, o.status_code, o.retryable, o.outcome_unknown
        )
        .unwrap();
    }
    table.push_str("];\n");
    std::fs::write(out_dir.join("error_table.rs"), table).unwrap();
}
