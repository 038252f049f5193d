//! Paged lists are bounded by what one page examines: a selector that matches a few of many
//! objects gets short (even empty) pages with continue tokens, each page examining at most
//! `LIST_EXAMINED_PER_PAGE` objects, and following the tokens finds every match once. An
//! unpaged list answers everything in one response up to its own budget, and beyond it is
//! refused whole (413, nothing partial) rather than answered short.
//!
//! The server runs in-process on 127.0.0.1:0 in a temporary directory.

use std::collections::BTreeMap;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use kruntimes_apiserver::http::handlers::LIST_EXAMINED_PER_PAGE;
use kube::api::{Api, ListParams, PostParams};

mod common;
use common::{server, server_with};

async fn create_leases(leases: &Api<Lease>, total: usize, picked: &[usize]) -> anyhow::Result<()> {
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
    Ok(())
}

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
    create_leases(&leases, total, &picked).await?;

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unpaged_list_past_its_budget_is_refused_whole_and_paging_reads_it_all()
-> anyhow::Result<()> {
    const BUDGET: usize = 300;
    let (_dir, _server, client) =
        server_with(|config| config.unpaged_list_examined = BUDGET).await?;
    let leases = Api::<Lease>::namespaced(client.clone(), "default");
    // Exactly the budget: answered whole.
    let picked = [0, BUDGET - 1, BUDGET];
    create_leases(&leases, BUDGET, &picked).await?;
    let all = leases.list(&ListParams::default()).await?;
    assert_eq!(all.items.len(), BUDGET);
    assert!(all.metadata.continue_.is_none_or(|t| t.is_empty()));
    let sparse = leases
        .list(&ListParams::default().labels("pick=yes"))
        .await?;
    assert_eq!(sparse.items.len(), 2);

    // One more object (a match, last by name): refused whole, with the way to page it.
    leases
        .create(
            &PostParams::default(),
            &lease(format!("l-{BUDGET:06}"), true),
        )
        .await?;
    for params in [
        ListParams::default(),
        ListParams::default().labels("pick=yes"),
    ] {
        match leases.list(&params).await {
            Err(kube::Error::Api(status)) => {
                assert_eq!(status.code, 413, "{status:?}");
                assert_eq!(status.reason, "RequestEntityTooLarge");
                assert!(status.message.contains("limit"), "{}", status.message);
            }
            other => panic!("an unpaged list past its budget answered {other:?}"),
        }
    }
    // Across namespaces too (a cluster-wide list walks the same objects).
    match Api::<Lease>::all(client).list(&ListParams::default()).await {
        Err(kube::Error::Api(status)) => assert_eq!(status.code, 413, "{status:?}"),
        other => panic!("an unpaged list of all namespaces answered {other:?}"),
    }

    // Paged, the same list reads every object once.
    let mut names = Vec::new();
    let mut token: Option<String> = None;
    for _ in 0..10 {
        let mut params = ListParams::default().limit(250);
        if let Some(token) = &token {
            params = params.continue_token(token);
        }
        let page = leases.list(&params).await?;
        names.extend(page.items.into_iter().filter_map(|l| l.metadata.name));
        token = page.metadata.continue_.filter(|t| !t.is_empty());
        if token.is_none() {
            break;
        }
    }
    assert!(token.is_none(), "the pages do not end");
    let expected: Vec<String> = (0..=BUDGET).map(|i| format!("l-{i:06}")).collect();
    assert_eq!(names, expected);
    Ok(())
}
