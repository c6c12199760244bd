pub mod checkpoint;
pub mod config;
pub mod error;
pub mod gpt2;
pub use error::LoadError;
