//! What a state store backend does: run SQL written once, in PostgreSQL's
//! `$1, $2, …` placeholder form, over a small set of value types.
//!
//! The SQL itself stays in the common dialect of SQLite and PostgreSQL
//! (`ON CONFLICT … DO NOTHING / DO UPDATE`, `CAST(… AS TEXT)`, `substr`,
//! `length`); the backends differ only in how they connect, bind, read
//! rows, report errors and migrate.

use std::fmt;

/// One SQL value, as bound to a placeholder or read from a column.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Null,
    Int(i64),
    Real(f64),
    Text(String),
    Blob(Vec<u8>),
}

impl Value {
    fn kind(&self) -> &'static str {
        match self {
            Value::Null => "NULL",
            Value::Int(_) => "an integer",
            Value::Real(_) => "a real number",
            Value::Text(_) => "text",
            Value::Blob(_) => "a blob",
        }
    }
}

macro_rules! int_value {
    ($($t:ty),*) => {$(
        impl From<$t> for Value {
            fn from(v: $t) -> Value {
                // Wider unsigned values wrap as they always have in the
                // SQLite store (u64 byte counts and start times fit).
                Value::Int(v as i64)
            }
        }
    )*};
}
int_value!(i32, i64, u32, u64, usize);

impl From<bool> for Value {
    fn from(v: bool) -> Value {
        Value::Int(v.into())
    }
}

impl From<f64> for Value {
    fn from(v: f64) -> Value {
        Value::Real(v)
    }
}

impl From<&str> for Value {
    fn from(v: &str) -> Value {
        Value::Text(v.to_string())
    }
}

impl From<String> for Value {
    fn from(v: String) -> Value {
        Value::Text(v)
    }
}

impl From<&String> for Value {
    fn from(v: &String) -> Value {
        Value::Text(v.clone())
    }
}

impl<T: Into<Value>> From<Option<T>> for Value {
    fn from(v: Option<T>) -> Value {
        v.map_or(Value::Null, Into::into)
    }
}

impl<T: Clone + Into<Value>> From<&Option<T>> for Value {
    fn from(v: &Option<T>) -> Value {
        v.clone().map_or(Value::Null, Into::into)
    }
}

/// Binds a list of Rust values as `&[Value]`.
#[macro_export]
macro_rules! params {
    ($($v:expr),* $(,)?) => {
        &[$($crate::Value::from($v)),*][..]
    };
}

/// One result row.
#[derive(Debug, Clone, PartialEq)]
pub struct Row(pub Vec<Value>);

impl Row {
    /// Column `i` as `T`; a NULL or a value of another type is an error
    /// naming the column (the database is damaged or the query is wrong).
    pub fn get<T: FromValue>(&self, i: usize) -> Result<T, BackendError> {
        let v = self.0.get(i).ok_or(BackendError::Column {
            index: i,
            expected: T::EXPECTED,
            found: "no such column",
        })?;
        T::from_value(v).ok_or(BackendError::Column {
            index: i,
            expected: T::EXPECTED,
            found: v.kind(),
        })
    }
}

/// A Rust type a column converts to.
pub trait FromValue: Sized {
    const EXPECTED: &'static str;
    fn from_value(v: &Value) -> Option<Self>;
}

impl FromValue for i64 {
    const EXPECTED: &'static str = "an integer";
    fn from_value(v: &Value) -> Option<i64> {
        match v {
            Value::Int(i) => Some(*i),
            _ => None,
        }
    }
}

macro_rules! narrow_int {
    ($($t:ty),*) => {$(
        impl FromValue for $t {
            const EXPECTED: &'static str = "an integer in range";
            fn from_value(v: &Value) -> Option<$t> {
                match v {
                    Value::Int(i) => <$t>::try_from(*i).ok(),
                    _ => None,
                }
            }
        }
    )*};
}
narrow_int!(i32, u32);

impl FromValue for u64 {
    const EXPECTED: &'static str = "an integer";
    fn from_value(v: &Value) -> Option<u64> {
        // The inverse of `From<u64> for Value`.
        i64::from_value(v).map(|i| i as u64)
    }
}

impl FromValue for bool {
    const EXPECTED: &'static str = "0 or 1";
    fn from_value(v: &Value) -> Option<bool> {
        match v {
            Value::Int(0) => Some(false),
            Value::Int(1) => Some(true),
            _ => None,
        }
    }
}

impl FromValue for f64 {
    const EXPECTED: &'static str = "a number";
    fn from_value(v: &Value) -> Option<f64> {
        match v {
            Value::Real(r) => Some(*r),
            Value::Int(i) => Some(*i as f64),
            _ => None,
        }
    }
}

impl FromValue for String {
    const EXPECTED: &'static str = "text";
    fn from_value(v: &Value) -> Option<String> {
        match v {
            Value::Text(s) => Some(s.clone()),
            _ => None,
        }
    }
}

impl FromValue for Vec<u8> {
    const EXPECTED: &'static str = "a blob";
    fn from_value(v: &Value) -> Option<Vec<u8>> {
        match v {
            Value::Blob(b) => Some(b.clone()),
            _ => None,
        }
    }
}

impl<T: FromValue> FromValue for Option<T> {
    const EXPECTED: &'static str = T::EXPECTED;
    fn from_value(v: &Value) -> Option<Option<T>> {
        match v {
            Value::Null => Some(None),
            other => T::from_value(other).map(Some),
        }
    }
}

/// Which database a backend talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    Sqlite,
    Postgres,
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendKind::Sqlite => "SQLite",
            BackendKind::Postgres => "PostgreSQL",
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("{0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("{}", error_chain(.0))]
    Postgres(#[from] postgres::Error),
    /// A unique or primary key constraint refused a row. `target` is
    /// `table.column` for single-column unique constraints on both
    /// backends (SQLite's wording; PostgreSQL's `<table>_<column>_key`
    /// constraint names are mapped to it), else the constraint's name.
    #[error("a row with the same {target} already exists")]
    Unique { target: String },
    #[error("column {index} of a result row is {found}, expected {expected}; the state database is damaged")]
    Column {
        index: usize,
        expected: &'static str,
        found: &'static str,
    },
    #[error("parameter ${index} cannot hold {value} (the statement wants {ty})")]
    Bind { index: usize, value: String, ty: String },
    #[error("a query expected one row and got {0}")]
    RowCount(usize),
    /// The PostgreSQL server went away and did not come back in time.
    #[error(
        "lost the connection to the PostgreSQL state store at {target} and could not reconnect for {waited} s \
         ({reason}); check that the server is running, then run the command again (`cairn pipeline resume` \
         continues a run)"
    )]
    Lost {
        target: String,
        reason: String,
        waited: u64,
    },
}

/// An error and its causes, one sentence: the `postgres` crate puts the
/// server's message ("db error") and the OS error ("error connecting to
/// server") in the source, not in the message.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        let text = cause.to_string();
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        next = cause.source();
    }
    out
}

/// A connection to a state database. Object safe: the `Db` holds a
/// `Box<dyn Backend>`.
pub trait Backend: Send {
    fn kind(&self) -> BackendKind;

    /// Runs one statement with `$N` placeholders; returns the rows changed.
    fn execute(&mut self, sql: &str, params: &[Value]) -> Result<u64, BackendError>;

    /// Runs one statement with `$N` placeholders; returns its rows.
    fn query(&mut self, sql: &str, params: &[Value]) -> Result<Vec<Row>, BackendError>;

    /// Runs a script of several statements without parameters (migrations).
    fn batch(&mut self, sql: &str) -> Result<(), BackendError>;

    /// Starts a transaction that takes the write lock at once where the
    /// backend has one (SQLite's `BEGIN IMMEDIATE`), so two writers queue
    /// instead of deadlocking on the upgrade from reader to writer.
    fn begin(&mut self) -> Result<(), BackendError>;
    fn commit(&mut self) -> Result<(), BackendError>;
    fn rollback(&mut self) -> Result<(), BackendError>;
}

impl dyn Backend + '_ {
    /// The rows of a query that returns at most one.
    pub fn query_opt(&mut self, sql: &str, params: &[Value]) -> Result<Option<Row>, BackendError> {
        let mut rows = self.query(sql, params)?;
        match rows.len() {
            0 => Ok(None),
            1 => Ok(rows.pop()),
            n => Err(BackendError::RowCount(n)),
        }
    }

    /// Runs `f` in a transaction: committed when it returns `Ok`, rolled
    /// back when it returns `Err` (so a failed statement, which aborts a
    /// PostgreSQL transaction, never leaves the connection unusable).
    pub fn transaction<T, E: From<BackendError>>(
        &mut self,
        f: impl FnOnce(&mut dyn Backend) -> Result<T, E>,
    ) -> Result<T, E> {
        self.begin()?;
        match f(&mut *self) {
            Ok(v) => {
                if let Err(e) = self.commit() {
                    let _ = self.rollback();
                    return Err(e.into());
                }
                Ok(v)
            }
            Err(e) => {
                let _ = self.rollback();
                Err(e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_convert_or_name_what_they_hold() {
        let row = Row(vec![
            Value::Int(7),
            Value::Null,
            Value::Text("x".into()),
            Value::Int(-1),
        ]);
        assert_eq!(row.get::<i64>(0).unwrap(), 7);
        assert_eq!(row.get::<Option<String>>(1).unwrap(), None);
        assert_eq!(row.get::<String>(2).unwrap(), "x");
        let err = row.get::<String>(0).unwrap_err().to_string();
        assert!(
            err.contains("column 0 of a result row is an integer, expected text"),
            "{err}"
        );
        assert!(row.get::<String>(1).is_err(), "NULL is not text");
        assert!(row.get::<u32>(3).is_err(), "-1 is not a u32");
        assert!(row.get::<i64>(9).is_err());
    }

    #[test]
    fn unsigned_values_round_trip_through_integers() {
        let v = Value::from(u64::MAX - 3);
        assert_eq!(u64::from_value(&v), Some(u64::MAX - 3));
        assert_eq!(Value::from(None::<&str>), Value::Null);
        assert_eq!(Value::from(Some("a")), Value::Text("a".into()));
    }
}
