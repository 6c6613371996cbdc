//! Listings in pages, as E2B's SDK pages them: at most `limit` items (1 to
//! 100, default 100) in order of when they started, and an opaque
//! `nextToken`, answered in the `x-next-token` header while more remain,
//! that the next request sends back. The token names the last item given
//! (its time and id), not a position, so a page never repeats or skips an
//! item that was there throughout while others come and go between pages.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;

use super::RestError;

/// The most items a page holds, and the default.
pub const MAX_LIMIT: i64 = 100;

/// The order of a listing, by start time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    Asc,
    Desc,
}

impl Order {
    /// `order=asc|desc`; newest first when not given, as E2B lists.
    pub fn parse(s: Option<&str>) -> Result<Order, RestError> {
        match s {
            None | Some("desc") => Ok(Order::Desc),
            Some("asc") => Ok(Order::Asc),
            Some(other) => Err(RestError::bad_request(format!(
                "order must be \"asc\" or \"desc\", not {other:?}"
            ))),
        }
    }
}

/// Where a page starts: just past the item with this time and id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    at: i64,
    id: String,
}

impl Cursor {
    fn token(&self) -> String {
        URL_SAFE_NO_PAD.encode(format!("{}:{}", self.at, self.id))
    }

    /// A `nextToken` this server gave, else 400.
    pub fn parse(token: Option<&str>) -> Result<Option<Cursor>, RestError> {
        let Some(token) = token.filter(|t| !t.is_empty()) else {
            return Ok(None);
        };
        let bad = || RestError::bad_request("nextToken is not one this server gave: list again without it");
        if token.len() > 1024 {
            return Err(bad());
        }
        let raw = URL_SAFE_NO_PAD.decode(token).map_err(|_| bad())?;
        let text = String::from_utf8(raw).map_err(|_| bad())?;
        let (at, id) = text.split_once(':').ok_or_else(bad)?;
        Ok(Some(Cursor {
            at: at.parse().map_err(|_| bad())?,
            id: id.to_string(),
        }))
    }
}

/// `limit=N`: 1 to [`MAX_LIMIT`], [`MAX_LIMIT`] when not given.
pub fn limit(l: Option<i64>) -> Result<usize, RestError> {
    match l {
        None => Ok(MAX_LIMIT as usize),
        Some(n) if (1..=MAX_LIMIT).contains(&n) => Ok(n as usize),
        Some(n) => Err(RestError::bad_request(format!(
            "limit must be 1 to {MAX_LIMIT}, not {n}: page through more with nextToken"
        ))),
    }
}

/// One page of `items` (each keyed by its time and id), in `order`, from
/// just past `after`; and the token of the next page when more remain.
pub fn page<T>(
    mut items: Vec<T>,
    key: impl Fn(&T) -> (i64, &str),
    order: Order,
    limit: usize,
    after: Option<&Cursor>,
) -> (Vec<T>, Option<String>) {
    items.sort_by(|a, b| {
        let by = key(a).cmp(&key(b));
        match order {
            Order::Asc => by,
            Order::Desc => by.reverse(),
        }
    });
    if let Some(c) = after {
        let past = (c.at, c.id.as_str());
        items.retain(|i| match order {
            Order::Asc => key(i) > past,
            Order::Desc => key(i) < past,
        });
    }
    if items.len() <= limit {
        return (items, None);
    }
    items.truncate(limit);
    let next = items.last().map(|i| {
        let (at, id) = key(i);
        Cursor { at, id: id.to_string() }.token()
    });
    (items, next)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_pages(items: &[(i64, &str)], order: Order, limit: usize) -> Vec<Vec<(i64, String)>> {
        let owned: Vec<(i64, String)> = items.iter().map(|(a, b)| (*a, b.to_string())).collect();
        let mut pages = Vec::new();
        let mut after = None;
        loop {
            let (got, next) = page(owned.clone(), |i| (i.0, i.1.as_str()), order, limit, after.as_ref());
            pages.push(got);
            match next {
                Some(t) => after = Cursor::parse(Some(&t)).unwrap(),
                None => return pages,
            }
        }
    }

    #[test]
    fn pages_cover_every_item_once_in_order_however_they_tie() {
        let items = [(5, "b"), (1, "z"), (5, "a"), (3, "x"), (5, "c"), (2, "y"), (9, "k")];
        for limit in 1..=8 {
            let asc: Vec<_> = all_pages(&items, Order::Asc, limit).concat();
            let want = [(1, "z"), (2, "y"), (3, "x"), (5, "a"), (5, "b"), (5, "c"), (9, "k")];
            assert_eq!(asc, want.iter().map(|(a, b)| (*a, b.to_string())).collect::<Vec<_>>());
            let mut desc: Vec<_> = all_pages(&items, Order::Desc, limit).concat();
            desc.reverse();
            assert_eq!(desc, asc, "limit {limit}");
            // A page is full but for the last one.
            let pages = all_pages(&items, Order::Asc, limit);
            assert!(pages[..pages.len() - 1].iter().all(|p| p.len() == limit));
        }
    }

    #[test]
    fn an_item_removed_between_pages_moves_nothing_else() {
        let items = vec![
            (1, "a".to_string()),
            (2, "b".to_string()),
            (3, "c".to_string()),
            (4, "d".to_string()),
        ];
        fn key(i: &(i64, String)) -> (i64, &str) {
            (i.0, i.1.as_str())
        }
        let (first, next) = page(items.clone(), key, Order::Asc, 2, None);
        assert_eq!(first.len(), 2);
        let after = Cursor::parse(next.as_deref()).unwrap();
        // "b" (the cursor's own item) and "c" go; a newer "e" comes.
        let now: Vec<_> = vec![(1, "a".into()), (4, "d".into()), (5, "e".into())];
        let (second, next) = page(now, key, Order::Asc, 2, after.as_ref());
        assert_eq!(second, vec![(4, "d".to_string()), (5, "e".to_string())]);
        assert_eq!(next, None);
    }

    #[test]
    fn bad_tokens_limits_and_orders_are_refused() {
        for t in ["%%%", "bm9jb2xvbg", &"A".repeat(2000)] {
            assert!(Cursor::parse(Some(t)).is_err(), "{t}");
        }
        assert_eq!(Cursor::parse(Some("")).unwrap(), None);
        for l in [0, -1, 101] {
            assert!(limit(Some(l)).is_err());
        }
        assert_eq!(limit(None).unwrap(), 100);
        assert!(Order::parse(Some("newest")).is_err());
        assert_eq!(Order::parse(None).unwrap(), Order::Desc);
    }
}
