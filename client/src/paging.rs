//! Walking a paginated listing: the broker's `List*` calls return a page and the token of
//! the next one (none on the last page); [`all_pages`] fetches pages until the last.

use crate::error::ClientError;
use std::future::Future;

/// One page and the next page's token (`None` on the last page).
pub(crate) type Page<T> = (Vec<T>, Option<String>);

/// Calls `page(token)` from the first page (empty token) to the last, concatenating them.
pub(crate) async fn all_pages<T, F, Fut>(mut page: F) -> Result<Vec<T>, ClientError>
where
    F: FnMut(String) -> Fut,
    Fut: Future<Output = Result<Page<T>, ClientError>>,
{
    let mut all = Vec::new();
    let mut token = String::new();
    loop {
        let (items, next) = page(token).await?;
        all.extend(items);
        match next {
            Some(t) => token = t,
            None => return Ok(all),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn walks_every_page_in_order_and_stops_at_the_last() {
        let mut asked = Vec::new();
        let all = all_pages(|token: String| {
            asked.push(token.clone());
            async move {
                Ok(match token.as_str() {
                    "" => (vec![1, 2], Some("b".to_string())),
                    "b" => (vec![3], Some("c".to_string())),
                    _ => (vec![4], None),
                })
            }
        })
        .await
        .unwrap();
        assert_eq!(all, vec![1, 2, 3, 4]);
        assert_eq!(asked, vec!["", "b", "c"]);
    }
}
