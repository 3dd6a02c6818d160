//! Thin entry point: everything lives in the library.
fn main() -> std::process::ExitCode {
    pxed::cli::main()
}
