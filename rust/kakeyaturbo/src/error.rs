//! The one error type of the codec. Every fallible entry point returns [`Result`].

use std::fmt;

/// What went wrong, by kind. The Python binding maps each kind onto one exception class.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// The data handed in is unusable: empty, non-finite, wrong length.
    InvalidInput(String),
    /// A parameter is outside its documented range.
    InvalidParameter(String),
    /// A byte container is truncated, corrupted or inconsistent.
    Corrupt(String),
    /// A container written by a newer format version than this build reads.
    UnsupportedVersion { found: u16, supported: u16 },
    /// A numerical routine failed (for example an eigen solver that did not converge).
    Numerical(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidInput(m) => write!(f, "invalid input: {m}"),
            Error::InvalidParameter(m) => write!(f, "invalid parameter: {m}"),
            Error::Corrupt(m) => write!(f, "corrupt container: {m}"),
            Error::UnsupportedVersion { found, supported } => write!(
                f,
                "container format version {found} is newer than the newest this build reads ({supported})"
            ),
            Error::Numerical(m) => write!(f, "numerical failure: {m}"),
        }
    }
}

impl std::error::Error for Error {}

pub(crate) fn param<T>(msg: impl Into<String>) -> Result<T> {
    Err(Error::InvalidParameter(msg.into()))
}

pub(crate) fn input<T>(msg: impl Into<String>) -> Result<T> {
    Err(Error::InvalidInput(msg.into()))
}

pub(crate) fn corrupt<T>(msg: impl Into<String>) -> Result<T> {
    Err(Error::Corrupt(msg.into()))
}
