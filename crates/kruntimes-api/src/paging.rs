//! Lists read page by page. The API server refuses an unpaged list that examines more
//! than its budget of objects (100,000 by default) rather than scanning without end, so
//! every list of a kind that grows with use (Runs, Snapshots, AccessTokens) pages.

use kube::Api;
use kube::api::ListParams;
use serde::de::DeserializeOwned;

/// Objects per page.
pub const PAGE: u32 = 500;

/// Every object that matches `params`, following continue tokens.
pub async fn list_all<K>(api: &Api<K>, params: &ListParams) -> Result<Vec<K>, kube::Error>
where
    K: Clone + DeserializeOwned + std::fmt::Debug,
{
    let mut params = params.clone().limit(PAGE);
    let mut items = Vec::new();
    loop {
        let page = api.list(&params).await?;
        items.extend(page.items);
        match page.metadata.continue_ {
            Some(token) if !token.is_empty() => params = params.continue_token(&token),
            _ => return Ok(items),
        }
    }
}
