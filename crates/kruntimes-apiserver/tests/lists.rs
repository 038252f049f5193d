//! Paged lists are bounded by what one page examines: a selector that matches a few of many
//! objects gets short (even empty) pages with continue tokens, each page examining at most
//! `LIST_EXAMINED_PER_PAGE` objects, and following the tokens finds every match once. An
//! unpaged list still answers everything in one response.
//!
//! The server runs in-process on 127.0.0.1:0 in a temporary directory.

use std::collections::BTreeMap;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use kruntimes_apiserver::http::handlers::LIST_EXAMINED_PER_PAGE;
use kube::api::{Api, ListParams, PostParams};

mod common;
use common::server;

fn lease(name: String, picked: bool) -> Lease {
    let mut lease = Lease::default();
    lease.metadata.name = Some(name);
    if picked {
        lease.metadata.labels = Some(BTreeMap::from([("pick".into(), "yes".into())]));
    }
    lease
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sparse_selector_pages_through_short_pages_and_finds_every_match() -> anyhow::Result<()> {
    let (_dir, _server, client) = server().await?;
    let leases = Api::<Lease>::namespaced(client, "default");
    // More objects than one page examines; the matches are the first, one in the middle
    // and the last by name (the order a list walks).
    let total = LIST_EXAMINED_PER_PAGE + LIST_EXAMINED_PER_PAGE / 2;
    let picked = [0, LIST_EXAMINED_PER_PAGE, total - 1];
    futures::stream::iter(0..total)
        .map(|i| {
            let leases = leases.clone();
            async move {
                leases
                    .create(
                        &PostParams::default(),
                        &lease(format!("l-{i:06}"), picked.contains(&i)),
                    )
                    .await
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<_>>()
        .await?;

    let mut found = Vec::new();
    let mut pages = 0;
    let mut token: Option<String> = None;
    loop {
        let mut params = ListParams::default().labels("pick=yes").limit(500);
        if let Some(token) = &token {
            params = params.continue_token(token);
        }
        let page = leases.list(&params).await?;
        pages += 1;
        found.extend(page.items.into_iter().filter_map(|l| l.metadata.name));
        token = page.metadata.continue_.filter(|t| !t.is_empty());
        if token.is_none() {
            break;
        }
        anyhow::ensure!(pages < 10, "the pages do not advance");
    }
    let expected: Vec<String> = picked.iter().map(|i| format!("l-{i:06}")).collect();
    assert_eq!(found, expected, "every match once, in order");
    assert!(pages >= 2, "one page examined all {total} objects");

    // The first page stops at the budget: the first match, and a continue token.
    let first = leases
        .list(&ListParams::default().labels("pick=yes").limit(500))
        .await?;
    assert_eq!(first.items.len(), 1);
    assert!(first.metadata.continue_.is_some_and(|t| !t.is_empty()));

    // Unpaged: everything at once.
    let all = leases
        .list(&ListParams::default().labels("pick=yes"))
        .await?;
    assert_eq!(all.items.len(), picked.len());
    assert!(all.metadata.continue_.is_none_or(|t| t.is_empty()));
    Ok(())
}
